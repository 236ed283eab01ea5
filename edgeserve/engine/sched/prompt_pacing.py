"""Pacing the prompt token a prefilling sequence is owed every step, when even that one token beside the decode
rows costs more than `max_decode_slowdown` allows (a prompt deep into a long context: its token attends to every
key before it). Such a step is then taken only now and then: each paced step's measured time is settled against
the limit (a step that leaves the deep prompt out banks what it stayed under, the step that gives it its token
spends what it went over), and the token goes when the bank covers the predicted excess. Settling measured times,
not predicted ones, keeps the decode rows' mean step within the limit even where the cost model is off, while the
deep prompt still moves at least once every `max_gap` + 1 steps."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FloorPacer:
    """The bank of time under the limit, kept while some prompt's owed token is being paced."""

    max_gap: int = 16  # deferred steps in a row at most: after that the owed tokens are paid whatever they cost
    slack: float = 0.0  # seconds the paced steps stayed under the limit, net of what they went over
    waited: int = 0  # deferred steps since the owed tokens were last paid

    def pay(self, over: float) -> bool:
        """Whether this step pays the owed tokens, which are predicted to take it `over` seconds past the limit."""
        if self.slack >= over or self.waited >= self.max_gap:
            self.waited = 0
            return True
        self.waited += 1
        return False

    def settle(self, under: float) -> None:
        """A paced step ran, `under` seconds below the limit as measured (negative: over it)."""
        self.slack += under

    def reset(self) -> None:
        """Every owed token fits under the limit again: nothing is paced, the bank is emptied."""
        self.slack, self.waited = 0.0, 0
