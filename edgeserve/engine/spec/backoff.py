"""Per-request back-off for speculation whose drafts are rarely accepted: a request stops drafting for a while when
its recent acceptance is surely below the rate at which drafting stops paying, then probes again (a longer pause each
time its acceptance is still low, a shorter one after a good probe; it drafts again once its acceptance is back
above that rate). A new request starts from the acceptance of the requests before it (engine-wide): where those
were surely below that rate it starts with a pause, so that each request does not pay again for the evidence.

The rate at which drafting stops paying is measured, not assumed (`StepCosts`): a verification of k drafts per
sequence gives 1 + k * acceptance tokens for what a drafting step costs over a plain one, so the break-even
acceptance is (cost ratio - 1) / k. A dense model's verification rows are cheap (a low break-even); an MoE's k + 1
rows read the union of their experts (a high one, which is what makes it back off where dense models keep
drafting)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


# what a request's acceptance is taken to be before its first verification: 1.2 of 2 drafts (a prior worth two
# drafts, so that one verification moves it: a request whose first drafts fail pauses at once where drafting
# costs much, as an MoE's does)
PRIOR_ACCEPTED, PRIOR_PROPOSED = 1.2, 2.0


def surely_below(rate: float, weight: float, threshold: float) -> bool:
    """Whether an acceptance `rate` seen over `weight` drafts is under `threshold` by more than one standard error."""
    return rate + math.sqrt(rate * (1 - rate) / weight) < threshold


@dataclass
class _Request:
    accepted: float = PRIOR_ACCEPTED  # accepted drafts, older verifications weighing less (Backoff.decay)
    proposed: float = PRIOR_PROPOSED  # proposed drafts, weighed the same
    wait: int = 0  # steps left without drafts
    pause: int = 0  # the length of the last pause (0: none, or drafting again)

    @property
    def rate(self) -> float:
        return self.accepted / self.proposed


@dataclass
class Backoff:
    """`drafts_now(id)` before proposing for a request, `record(id, proposed, accepted)` after verifying it,
    `forget(id)` when it ends. `threshold`: the acceptance below which drafting costs more than it saves (the
    engine sets it from `StepCosts.break_even` as steps are measured)."""

    threshold: float
    decay: float = 0.95  # weight of the counts so far at each verification (about the last twenty count)
    first_pause: int = 4
    max_pause: int = 64
    engine_decay: float = 0.98  # the same for the engine-wide counts, over every request's verifications
    _requests: dict[object, _Request] = field(default_factory=dict)
    # every request's verifications, the prior included: what a new request's acceptance is taken to be
    _engine: _Request = field(default_factory=_Request)

    def _request(self, request_id: object) -> _Request:
        """The request's counts; a new request's start from the engine's acceptance (worth PRIOR_PROPOSED drafts),
        and it starts paused where the requests before it were surely below the threshold."""
        r = self._requests.get(request_id)
        if r is None:
            e = self._engine
            r = self._requests[request_id] = _Request(PRIOR_PROPOSED * e.rate, PRIOR_PROPOSED)
            if surely_below(e.rate, e.proposed, self.threshold):
                r.pause = r.wait = self.first_pause
        return r

    def drafts_now(self, request_id: object) -> bool:
        """Whether the request drafts this step (a paused one counts its pause down instead)."""
        r = self._request(request_id)
        if r.wait == 0:
            return True
        r.wait -= 1
        return False

    def paused(self, request_id: object) -> bool:
        """Whether the request is pausing its drafts (its next step does not draft either)."""
        return self._request(request_id).wait > 0

    def record(self, request_id: object, proposed: int, accepted: int) -> None:
        """One verification of `proposed` drafts of which `accepted` were kept."""
        if proposed <= 0:
            return
        e = self._engine
        e.accepted = self.engine_decay * e.accepted + accepted
        e.proposed = self.engine_decay * e.proposed + proposed
        r = self._request(request_id)
        r.accepted = self.decay * r.accepted + accepted
        r.proposed = self.decay * r.proposed + proposed
        if r.rate >= self.threshold:
            r.pause = 0
            return
        if not r.pause and not surely_below(r.rate, r.proposed, self.threshold):
            return  # a drafting request pauses only once its acceptance is surely low (one standard error)
        if r.pause and accepted / proposed >= self.threshold:
            r.pause = max(self.first_pause, r.pause // 2)  # a good probe: look again sooner
        else:
            r.pause = min(self.max_pause, 2 * r.pause if r.pause else self.first_pause)
        r.wait = r.pause

    def forget(self, request_id: object) -> None:
        self._requests.pop(request_id, None)


@dataclass
class StepCosts:
    """Moving averages of decode steps' wall times per batch size, without drafts and with every sequence drafting
    k tokens: what a verification step costs over a plain one, as measured on this machine and model."""

    smoothing: float = 0.2  # weight of the newest step
    _plain: dict[int, float] = field(default_factory=dict)
    _drafting: dict[int, float] = field(default_factory=dict)

    def record(self, seqs: int, drafting: bool, seconds: float) -> None:
        """One decode step of `seqs` sequences, each drafting (`drafting`) or none, that took `seconds`."""
        if seqs <= 0 or seconds <= 0:
            return
        table = self._drafting if drafting else self._plain
        old = table.get(seqs)
        table[seqs] = seconds if old is None else old + self.smoothing * (seconds - old)

    def ratio(self, seqs: int) -> float | None:
        """A drafting step's time over a plain one's at `seqs` sequences; None until both were measured."""
        plain, drafting = self._plain.get(seqs), self._drafting.get(seqs)
        return None if plain is None or drafting is None else drafting / plain

    def break_even(self, seqs: int, k: int) -> float | None:
        """The acceptance (accepted over proposed drafts) at which k drafts per step give as many tokens per second
        as plain steps, at `seqs` sequences (above 1: drafting never pays); None until measured."""
        r = self.ratio(seqs)
        return None if r is None else max(0.0, (r - 1.0) / k)
