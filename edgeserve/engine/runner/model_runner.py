"""Runs one scheduled step: a flat ragged batch through the model over the paged KV pool, up to the logits."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.formats.quant_linear import PromptRows
from edgeserve.kernels.transfer import take_rows, to_device
from edgeserve.models.encoder_threads import intra_op_threads
from edgeserve.models.llama import LlamaModel
from edgeserve.models.lora_step import StepLora

from .cuda_graphs import DecodeGraphs
from .input_batch import InputBatch
from ..cache.kv_cache import KVPool, forward_inputs
from ..sched.request_state import Registry
from ..sched.scheduler import SchedulerOutput
from ..cache.state_pool import StatePool, StepStates

# A CPU step of at most this many rows runs torch's own ops on one thread: they are a few microseconds of work each,
# and torch's OpenMP team spinning beside the native kernels' pool on the same cores made them 50-100x slower
# (a MoE decode step's row gathers: docs/perf-log/2026-11-to-12.md, the quiet evening section).
SMALL_STEP_ROWS = 64


@dataclass
class TokenFill:
    """Step tokens the host does not know yet: the previous step's sampled ids, still on the device (the one-step
    overlap schedules a sequence's next token before its sampled id reaches the host)."""

    index: list[int]  # flat rows of this step's token ids that hold a placeholder
    source: list[int]  # the row of `ids` each of them takes
    ids: torch.Tensor  # [B] the previous step's sampled ids, on the device

    def apply(self, tokens: torch.Tensor) -> None:
        """Write the device-side ids into `tokens` (this step's flat token ids, on the device)."""
        dev = tokens.device
        tokens[to_device(self.index, torch.long, dev)] = self.ids[to_device(self.source, torch.long, dev)]


class ModelRunner:
    """Owns the model and its KV pool; turns a SchedulerOutput into the logits its sampling rows need."""

    def __init__(self, model: LlamaModel, pool: KVPool, max_num_seqs: int, max_model_len: int,
                 graphs: DecodeGraphs | None = None, max_num_tokens: int = 2048,
                 registry: Registry | None = None, states: StatePool | None = None) -> None:
        """`max_num_tokens`: the most tokens a step computes (its host buffers start that large and grow);
        `registry`: the engine's request states, which keep each sequence's batch row; `states`: a hybrid model's
        recurrent-state pool (each scheduled sequence's `state_slot` indexes it)."""
        self.model = model
        self.pool = pool
        self.states = states
        self.device = model.device
        # each running sequence's block table, kept on the device and updated in place
        self.batch = InputBatch(max_num_seqs, -(-max_model_len // pool.block_size), model.device, max_num_tokens,
                                rows=registry.view("batch_row") if registry is not None else None)
        self.registry = registry
        if self.device.type == "cpu":
            cpu_native.library()  # sized from torch's thread count here, not inside a one-thread small step
        self.graphs = graphs  # decode steps go through these (CUDA graphs) when set; see engine.runner.cuda_graphs
        self.keep_hidden = False  # keep each step's hidden states [T, hidden] in `hidden` (MTP speculation)
        # verification steps keep their drafts off a hybrid's states, `replay` advances them (Engine.set_draft_replay)
        self.replay_drafts = False
        self.hidden: torch.Tensor | None = None

    def execute(self, step: SchedulerOutput, fill: TokenFill | None = None) -> torch.Tensor | None:
        """Run the step's tokens; the logits of each sampling sequence's last 1 + num_spec rows (its next token's
        and, when it verifies drafts, theirs), stacked in batch order ([rows, vocab]).

        `fill` supplies token ids that are still on the device. Returns None when no sequence samples (every one
        was mid-prefill). The tensors stay on the device: nothing here waits for the step to finish.
        """
        scheduled, dev = step.scheduled, self.device
        if not scheduled:
            return None
        inputs = self.batch.prepare(scheduled)
        sample_seqs = [i for i, s in enumerate(scheduled) if s.samples]
        lora = self._step_lora(scheduled, inputs.query_lens)
        images = image_rows(scheduled, dev)  # a graph replays token embeddings only: a step with images runs eager
        mrope = step_mrope(scheduled, dev)
        if (sample_seqs and lora is None and images is None and mrope is None and self.graphs is not None
                and self.graphs.can_run(inputs.query_lens, inputs.block_tables.shape[1])):
            logits = self.graphs.run(inputs, fill)
            return take_rows(logits, sample_seqs)
        small = dev.type == "cpu" and sum(inputs.query_lens) <= SMALL_STEP_ROWS
        with intra_op_threads(1 if small else None):
            states = self._step_states(scheduled, inputs.query_lens)
            hidden = forward_inputs(self.model, self.pool, inputs, _prompt_rows(step, dev), fill, states, lora,
                                    images, mrope, step_spans(scheduled))
            if states is not None and states.keep is not None and not states.kept:
                raise RuntimeError("a verification step ran on a path that does not keep drafts off the states")
            self.hidden = hidden if self.keep_hidden else None
            if not sample_seqs:
                return None
            rows = [r for end, s in zip(itertools.accumulate(inputs.query_lens), scheduled) if s.samples
                    for r in range(end - 1 - s.num_spec, end)]
            return self.model.logits(take_rows(hidden, rows))


    def _step_lora(self, scheduled, query_lens: list[int]) -> StepLora | None:
        """The step's LoRA adapters by row (None when no sequence runs one)."""
        if self.registry is None:
            return None
        choices = [getattr(self.registry.get(s.seq_id), "adapter", None) for s in scheduled]
        if all(c is None for c in choices):
            return None
        return StepLora.build([(c.adapter, c.scale) if c is not None else None for c in choices], query_lens,
                              self.device)

    def _step_states(self, scheduled, query_lens: list[int]) -> StepStates | None:
        """The step's recurrent states (a hybrid model's): each sequence's rows and state slot, on the device."""
        if self.states is None:
            return None
        keep = ([s.num_new_tokens - s.num_spec for s in scheduled]
                if self.replays_now() and any(s.num_spec for s in scheduled) else None)
        return StepStates.build(self.states, [0, *itertools.accumulate(query_lens)],
                                [s.state_slot for s in scheduled], keep)

    def _recurrent_plan(self):
        """The model's fused plan's recurrent mixers (kernels.cpu.recurrent_step.RecurrentStep), or None."""
        native = getattr(self.model, "native_decoder", None)
        plan = native() if native is not None else None
        return getattr(plan, "recurrent", None), plan

    def can_replay_drafts(self) -> bool:
        """Whether this model's steps can keep drafts off its recurrent states: its fused plan's mixers replay (Gated
        DeltaNet) and run over this state pool."""
        recurrent, _ = self._recurrent_plan()
        return (self.states is not None and recurrent is not None and recurrent.replays and self.graphs is None
                and recurrent.takes(StepStates.build(self.states, [0, 1], [0]), 1))

    def replays_now(self) -> bool:
        """Whether this step keeps its drafts off the recurrent states: `replay_drafts` is on and the fused stack
        runs now (the native kernels on, the plan not set aside; otherwise the state backup / restore)."""
        from edgeserve.kernels.dispatch import backend

        return (self.replay_drafts and self._recurrent_plan()[0] is not None and backend() == "auto"
                and cpu_native.available())

    def replay(self, accepted: list[int]) -> None:
        """After a verification step run with `replay_drafts`: advance each scheduled sequence's states (in the
        step's batch order) by its first accepted[i] drafts."""
        recurrent, plan = self._recurrent_plan()
        recurrent.replay(plan.lib, accepted)


def _prompt_rows(step: SchedulerOutput, device: torch.device) -> PromptRows | None:
    """Which of the step's rows are prompt tokens (None in a step of decodes only)."""
    if all(s.positions[0] >= s.num_prompt_tokens for s in step.scheduled):
        return None
    return PromptRows.build([p < s.num_prompt_tokens for s in step.scheduled for p in s.positions], device)


def image_rows(scheduled: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The step's rows whose embeddings an image replaces: their flat indices [n] and the rows [n, hidden], the
    part of each image that this step's chunk of its prompt covers (None when no chunk covers an image)."""
    index: list[torch.Tensor] = []
    rows: list[torch.Tensor] = []
    offset = 0
    for s in scheduled:
        first, count = s.positions[0], len(s.positions)
        for start, emb in s.images:
            lo, hi = max(start, first), min(start + emb.shape[0], first + count)
            if lo < hi:
                index.append(torch.arange(offset + lo - first, offset + hi - first))
                rows.append(emb[lo - start: hi - start])
        offset += count
    if not index:
        return None
    return torch.cat(index).to(device), torch.cat(rows).to(device)


def step_spans(scheduled: list) -> list[tuple] | None:
    """Each sequence's bidirectional prompt spans this step's chunk reaches (AttentionMetadata.attend_spans), or None
    when no chunk of the step has any."""
    spans = [tuple((a, b) for a, b in s.attend_spans if b > s.positions[0] and a < s.positions[-1] + 1)
             for s in scheduled]
    return spans if any(spans) else None


def step_mrope(scheduled: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """For a step with M-RoPE requests (images in a Qwen-VL prompt; models.mrope): each token's 1-D position with its
    request's offset, and the [3, T] (t, h, w) positions where an image's tokens are in the step (else None, so
    the step runs 1-D RoPE, the fused native stack included). None when no sequence has M-RoPE positions."""
    if all(s.mrope is None for s in scheduled):
        return None
    parts, flat = [], True
    for s in scheduled:
        first, n = s.positions[0], len(s.positions)
        if s.mrope is None:
            parts.append(torch.arange(first, first + n).expand(3, n))
        else:
            parts.append(s.mrope.rows(first, n))
            flat = flat and s.mrope.is_flat(first, n)
    table = torch.cat(parts, dim=1).to(device)
    return table[0], None if flat else table
