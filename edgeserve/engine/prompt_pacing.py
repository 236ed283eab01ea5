"""Pacing the prompt token a prefilling sequence is owed every step, when even that one token beside the decode
rows costs more than `max_decode_slowdown` allows (a prompt deep into a long context: its token attends to every
key before it). Such a step is then taken only now and then: a step that leaves the deep prompt out banks the time
it stays under the limit, and the step that gives it its token spends what it goes over, so the decode rows' mean
step time stays within the limit while the deep prompt still moves at least once every `max_gap` steps."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FloorPacer:
    """The bank of time under the limit, kept while some prompt's owed token is being deferred."""

    max_gap: int = 16  # deferred steps in a row at most: after that the owed tokens are paid whatever they cost
    slack: float = 0.0  # seconds the deferred steps stayed under the limit, not yet spent
    waited: int = 0  # deferred steps since the owed tokens were last paid

    def pay(self, over: float) -> bool:
        """Whether this step pays the owed tokens, which take it `over` seconds past the limit (spending the bank
        when it does)."""
        if self.slack >= over or self.waited >= self.max_gap:
            self.slack, self.waited = max(0.0, self.slack - over), 0
            return True
        return False

    def defer(self, under: float) -> None:
        """This step left the owed tokens out and is predicted to stay `under` seconds below the limit."""
        self.slack += max(0.0, under)
        self.waited += 1

    def reset(self) -> None:
        """Every owed token fits under the limit again: nothing is deferred, the bank is emptied."""
        self.slack, self.waited = 0.0, 0
