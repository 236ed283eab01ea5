"""A per-request thinking budget: after `budget` tokens of reasoning the engine writes the model's own closing tag
(its token ids, forced one per step by the sampler) and the answer follows, sampled as usual.

The thought starts where the prompt opened it (`in_thought`) or where the model writes the opening tag; it ends
early, and nothing is forced, where the model writes the closing tag itself. A request that never opens a thought
is never touched.

`end_now()` closes a running thought at once, whatever is left of the budget (a client's "stop thinking and
answer"); a state made for a request that had none replays its output so far first (`resume`)."""

from __future__ import annotations

from dataclasses import dataclass

OPEN_SLACK = 4  # tokens (a newline or two) a reply may write before the opening tag of its thought


@dataclass(frozen=True)
class ThinkingBudget:
    """What a request asks (SamplingParams.thinking): at most `budget` reasoning tokens, then `close_ids`."""

    budget: int
    close_ids: tuple[int, ...]  # the closing tag's tokens (e.g. `</think>`), forced in order once the budget is spent
    open_ids: tuple[int, ...] = ()  # the opening tag's tokens, where the model opens the thought itself
    in_thought: bool = False  # the prompt opened the thought: the first output token is reasoning

    def __post_init__(self) -> None:
        if not isinstance(self.budget, int) or isinstance(self.budget, bool) or self.budget < 0:
            raise ValueError(f"thinking budget must be a non-negative integer, got {self.budget!r}")
        if not self.close_ids:
            raise ValueError("a thinking budget needs the closing tag's token ids")


class ThinkingState:
    """One running request's reasoning: tokens spent, and the closing tag's tokens still to force."""

    def __init__(self, spec: ThinkingBudget) -> None:
        self.spec = spec
        self.in_thought = spec.in_thought
        self.done = False  # the thought closed (by the model or forced): nothing more to do
        self.spent = 0
        self._seen = 0  # output tokens so far
        self._tail: list[int] = []  # the last output tokens, to find a tag written across tokens
        self._forcing: list[int] = []
        self._end_now = False

    @classmethod
    def resume(cls, spec: ThinkingBudget, output: list[int]) -> "ThinkingState":
        """A state for a request already running without one: its output tokens so far accounted for."""
        state = cls(spec)
        state.accept(output)
        return state

    @property
    def thinking(self) -> bool:
        """Whether the reply is in its thought now, or may still open one."""
        return not self.done

    def end_now(self) -> bool:
        """Close the thought at the next step (or as soon as the reply opens one); False when it is already closed
        (the reply is answering)."""
        self._end_now = not self.done
        return self._end_now

    @property
    def active(self) -> bool:
        """Whether the next token may be forced (the engine then reads this request's tokens before its next step)."""
        return not self.done

    def forced(self) -> int | None:
        """The token the next step must take, or None to sample."""
        if not self.done and self.in_thought and not self._forcing and (self._end_now
                                                                         or self.spent >= self.spec.budget):
            self._forcing = list(self.spec.close_ids)
        return self._forcing[0] if self._forcing else None

    def accept(self, tokens: list[int]) -> None:
        """Account for the request's new output tokens."""
        for t in tokens:
            if self.done:
                return
            self._tail = (self._tail + [t])[-max(len(self.spec.close_ids), len(self.spec.open_ids), 1):]
            if self._forcing:
                if t == self._forcing[0]:
                    self._forcing.pop(0)
                self.done = not self._forcing
                continue
            self._seen += 1
            if not self.in_thought:
                if self.spec.open_ids and _ends_with(self._tail, self.spec.open_ids):
                    self.in_thought = True
                elif self._seen >= len(self.spec.open_ids) + OPEN_SLACK:
                    self.done = True  # the reply did not start with a thought: an answer, left alone
                continue
            if _ends_with(self._tail, self.spec.close_ids):
                self.done = True  # the model closed its thought within the budget
            else:
                self.spent += 1


def _ends_with(tokens: list[int], tag: tuple[int, ...]) -> bool:
    return bool(tag) and len(tokens) >= len(tag) and tuple(tokens[-len(tag):]) == tag
