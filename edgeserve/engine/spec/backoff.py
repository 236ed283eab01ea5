"""Per-request back-off for speculation whose drafts are rarely accepted: a request stops drafting for a while when
its recent acceptance falls below the rate at which drafting stops paying, then tries again (a longer pause each
time it is still low, up to a cap; a good probe ends the pauses)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Request:
    rate: float = 1.0  # moving average of the accepted fraction of its drafts (optimistic at first)
    wait: int = 0  # steps left without drafts
    pause: int = 0  # the length of the last pause (0: none yet, or the last probe went well)


@dataclass
class Backoff:
    """`drafts_now(id)` before proposing for a request, `record(id, proposed, accepted)` after verifying it,
    `forget(id)` when it ends. `threshold`: the acceptance below which drafting costs more than it saves."""

    threshold: float
    smoothing: float = 0.3  # weight of the newest verification in the average
    first_pause: int = 4
    max_pause: int = 64
    _requests: dict[object, _Request] = field(default_factory=dict)

    def drafts_now(self, request_id: object) -> bool:
        """Whether the request drafts this step (a paused one counts its pause down instead)."""
        r = self._requests.get(request_id)
        if r is None or r.wait == 0:
            return True
        r.wait -= 1
        return False

    def record(self, request_id: object, proposed: int, accepted: int) -> None:
        """One verification of `proposed` drafts of which `accepted` were kept."""
        if proposed <= 0:
            return
        r = self._requests.setdefault(request_id, _Request())
        r.rate += self.smoothing * (accepted / proposed - r.rate)
        if r.rate < self.threshold:
            r.pause = min(self.max_pause, 2 * r.pause if r.pause else self.first_pause)
            r.wait = r.pause
            r.rate = self.threshold  # the probe after the pause decides again
        else:
            r.pause = 0

    def forget(self, request_id: object) -> None:
        self._requests.pop(request_id, None)
