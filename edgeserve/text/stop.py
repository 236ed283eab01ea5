"""Stop strings matched on streamed text, across token boundaries."""

from __future__ import annotations


class StopMatcher:
    """Feed text as it is generated; get back what is safe to show and whether a stop string was hit.

    Text that could be the start of a stop string is held back until the next pieces decide it, so
    nothing shown is ever retracted. Generation stops as soon as a stop string is complete: the match
    that ends first wins (the longest one, if several end there) and only the text before it is returned.
    """

    def __init__(self, stop: list[str]):
        self.stop = [s for s in stop if s]  # an empty stop string would match everywhere; it means nothing
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add generated text; return `(text to emit, stopped)`. After a stop, returns ('', True)."""
        if self.stopped:
            return "", True
        buf = self._held + text
        ends = [(i + len(s), -len(s), s) for s in self.stop if (i := buf.find(s)) >= 0]
        if ends:
            end, minus_len, self.matched = min(ends)
            self.stopped, self._held = True, ""
            return buf[: end + minus_len], True
        # No stop string is complete in buf, so the earliest one still possible starts in the
        # longest suffix of buf that is a proper prefix of some stop string: hold that back.
        hold = max((self._partial(buf, s) for s in self.stop), default=0)
        self._held = buf[len(buf) - hold:]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """The held-back text, for when generation ends for another reason than a stop string."""
        held, self._held = self._held, ""
        return held

    @staticmethod
    def _partial(buf: str, stop: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of `stop`."""
        for k in range(min(len(stop) - 1, len(buf)), 0, -1):
            if buf.endswith(stop[:k]):
                return k
        return 0
