"""The one per-request state and the one registry of it, shared by id by the engine core, the scheduler and the
block manager.

A request is one `Sequence` object (the engine core's are `Request`s: a Sequence with its sampling and text state); its
token ids are held once, in `all_token_ids` (prompt, then outputs); the block manager's part of it (block table,
prefix-cache chain) is its `kv` attribute, set and cleared through `Registry.view("kv")`, and its row in the
persistent input batch is `batch_row` (`Registry.view("batch_row")`). Whoever adds a request to
the registry removes it: the engine core when a request ends, or a standalone Scheduler when it finishes one.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, MutableMapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from edgeserve.sampling_params import SamplingParams

from ..cache.prefix_key import NO_KEY, PrefixKey
from ..outputs import SpecCounters

if TYPE_CHECKING:
    import torch

    from edgeserve.models.mrope import MRopePositions
    from edgeserve.text.grammar import GrammarState

    from ..runner.adapters import AdapterChoice
    from .thinking_budget import ThinkingState

    from .output_processor import OutputProcessor

SeqId = Hashable
# (position of the first placeholder token, its embedding rows [n, hidden]): an image's rows in the prompt
ImageRows = tuple[int, "torch.Tensor"]
# [start, end) prompt positions whose tokens attend to each other both ways in prefill (one Gemma 3 image)
AttendSpan = tuple[int, int]


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's token and scheduling state. `Sequence(seq_id, prompt_ids)` starts with the prompt."""

    seq_id: SeqId
    all_token_ids: list[int]  # prompt + outputs: the only copy of the request's token ids (read-only outside)
    num_prompt_tokens: int = -1  # -1: all of all_token_ids at construction
    num_computed_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    arrival: int = -1  # set by Scheduler.add
    finish_reason: str | None = None
    swapped: bool = False  # preempted with its KV in host swap space (num_computed_tokens kept)
    spec_token_ids: list[int] = field(default_factory=list)  # proposed continuation to verify next step
    kv: Any = field(default=None, repr=False)  # the block manager's part (kv_blocks._SeqBlocks) while it has blocks
    batch_row: int | None = None  # its row in the persistent input batch while it runs (input_batch.InputBatch)
    prefix_key: PrefixKey = NO_KEY  # what besides its tokens enters its blocks' hashes (adapter, images)
    images: tuple[ImageRows, ...] = ()  # embedding rows that replace prompt placeholder tokens' (images)
    mrope: MRopePositions | None = None  # M-RoPE positions of a request with images (Qwen-VL; models.mrope)
    attend_spans: tuple[AttendSpan, ...] = ()  # bidirectional prompt spans (Gemma 3's images), sorted, disjoint
    snapshot_points: tuple[int, ...] = ()  # a hybrid's prompt positions whose state is kept (state_cache)

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.all_token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt (a copy: hot paths use `all_token_ids` and `num_prompt_tokens`)."""
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """The tokens generated so far (a copy)."""
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    def append_output(self, token_ids: list[int]) -> None:
        """Append generated tokens."""
        self.all_token_ids.extend(token_ids)

    def set_output(self, index: int, token_id: int) -> None:
        """Replace output token `index` (a placeholder the one-step overlap appended) with its real id."""
        self.all_token_ids[self.num_prompt_tokens + index] = token_id

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_remaining(self) -> int:
        """Tokens whose KV is not computed yet."""
        return self.num_tokens - self.num_computed_tokens


@dataclass(eq=False)
class Request(Sequence):
    """One request's whole engine-side state: its tokens and scheduling (`Sequence`) plus how it samples and
    becomes text. It lives in the core's Registry (shared with the scheduler and the block manager) until it ends."""

    params: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None
    stop_ids: frozenset[int] = frozenset()
    max_tokens: int = 0  # params.max_tokens capped by the room left in the context
    proc: OutputProcessor | None = None  # token ids -> text deltas, stop strings
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache supplied at first admission
    grammar: GrammarState | None = None  # constrained decoding: advanced by every accepted token
    draft_probs: torch.Tensor | None = None  # a draft model's proposal distributions, for this step's verification
    adapter: AdapterChoice | None = None  # the LoRA adapter it runs (engine.runner.adapters), held until it ends
    thinking: ThinkingState | None = None  # a thinking budget: reasoning tokens spent, the closing tag to force
    spec: SpecCounters = field(default_factory=SpecCounters)  # its drafts proposed and accepted (its usage)

    @property
    def request_id(self) -> str:
        return self.seq_id


class Registry(dict):
    """Every live request's state by id (`dict[SeqId, Sequence]`): the one place the core, the scheduler and the
    block manager look a request up."""

    def view(self, attr: str) -> "PartView":
        """The requests' `attr` part as a mapping by id (only those whose part is set)."""
        return PartView(self, attr)


class PartView(MutableMapping):
    """One attribute of the registry's entries as a mapping: `view[id] = part` sets `registry[id].<attr>`,
    `del view[id]` clears it; ids without the part are absent. The entry itself must be registered first."""

    def __init__(self, registry: Registry, attr: str) -> None:
        self._registry = registry
        self._attr = attr

    def __getitem__(self, seq_id: SeqId) -> Any:
        part = getattr(self._registry[seq_id], self._attr)
        if part is None:
            raise KeyError(seq_id)
        return part

    def __setitem__(self, seq_id: SeqId, part: Any) -> None:
        setattr(self._registry[seq_id], self._attr, part)

    def __delitem__(self, seq_id: SeqId) -> None:
        self[seq_id]  # KeyError when absent
        setattr(self._registry[seq_id], self._attr, None)

    def __contains__(self, seq_id: object) -> bool:
        entry = self._registry.get(seq_id)
        return entry is not None and getattr(entry, self._attr) is not None

    def __iter__(self) -> Iterator[SeqId]:
        return (k for k, e in self._registry.items() if getattr(e, self._attr) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)
