"""What the engine hands back: per-request deltas and engine-wide counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no torch at import: the CLI's --help path imports the request state, which counts drafts here
    from edgeserve.offload.tier_manager import OffloadStats


@dataclass
class TokenLogprob:
    """One generated token's logprob and its best alternatives (see sampler.SampleOutput for which distribution)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class SpecCounters:
    """Speculative decoding's counts: an engine's running totals (/metrics), or one request's (its usage)."""

    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens the target accepted
    verifications: int = 0  # sequence-steps with at least one draft token

    def add(self, proposed: int, accepted: int) -> None:
        """One verification of `proposed` drafts, `accepted` of them kept."""
        self.proposed += proposed
        self.accepted += accepted
        self.verifications += 1

    def merge(self, other: "SpecCounters") -> None:
        """Add another's counts (the choices of one reply)."""
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.verifications += other.verifications

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification: the accepted drafts plus the target's own next token."""
        return 1.0 + self.accepted / self.verifications if self.verifications else 0.0


@dataclass
class TokenOutput:
    """What one step produced for one request (token ids, before any text work)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None  # "stop" (end-of-turn / stop token), "length" or "abort"
    stop_reason: int | None = None  # the stop token id
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    spec: SpecCounters | None = None  # the request's speculative counts so far (None: it never drafted)


@dataclass
class RequestOutput:
    """What one request gained since its previous delta; the last one has `finish_reason` set."""

    request_id: str
    text: str  # new text, final: never retracted or changed later
    token_ids: list[int]  # new token ids (a stop string's tokens included; the text stops before it)
    logprobs: list[TokenLogprob] | None  # one per new token when the request asked for logprobs
    finish_reason: str | None  # None while running, else "stop", "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or end-of-turn token id that ended it
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    num_output_tokens: int = 0  # tokens generated so far
    spec: SpecCounters | None = None  # its speculative decoding so far (None: it never drafted)
    # chat replies, filled by the server's output parsing (edgeserve.text.chat_output): `text` is then the content
    reasoning: str = ""  # new reasoning text (<think>...</think>)
    tool_calls: list | None = None  # edgeserve.text.tool_calls.ToolCall, on the last delta
    error: str | None = None  # the engine ended this request on a failure of its own (finish_reason "abort")

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineStats:
    """A snapshot of the engine's counters (for /metrics, /api/ps and `edgeserve bench`)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0  # held by a running request
    kv_blocks_cached: int = 0  # free but still holding a reusable prefix
    kv_block_size: int = 16
    kv_cache_bytes: int = 0
    kv_cache_dtype: str = ""  # what the pool stores per value (engine.cache.kv_format): bf16, f16, f32, q8_0, fp8
    prompt_tokens_computed: int = 0
    prompt_tokens_reused: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    num_requests_finished: int = 0
    num_steps: int = 0
    offload: OffloadStats | None = None  # KV tiers (blocks, hits, bytes moved, swaps) when offload is on
    # a hybrid model's recurrent states (engine.cache.state_cache; zero for other models): slots for running sequences
    # (seats) and for prefix-cache snapshots, those in use, and the pool's bytes (part of the KV budget)
    state_slots_total: int = 0
    state_slots_used: int = 0
    state_snapshots: int = 0
    state_snapshots_total: int = 0
    state_bytes: int = 0
    prompt_tokens_from_states: int = 0  # prompt tokens not computed because a sequence resumed from a snapshot
    # speculative decoding (zero when it is off)
    spec_proposed_tokens: int = 0  # draft tokens sent to verification
    spec_accepted_tokens: int = 0  # of those, accepted by the target
    spec_verifications: int = 0  # sequence-steps that verified at least one draft token
    spec_acceptance_rate: float = 0.0  # accepted / proposed
    spec_mean_accepted_length: float = 0.0  # tokens emitted per verification: 1 + accepted / verifications
