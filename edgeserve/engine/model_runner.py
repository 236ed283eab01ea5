"""Runs one scheduled step: a flat ragged batch through the model over the paged KV pool, then the sampler."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgeserve.kernels.paged_attention import AttentionMetadata
from edgeserve.kernels.quant_linear import PromptRows
from edgeserve.kernels.transfer import to_device
from edgeserve.models.llama import LlamaModel
from edgeserve.sampling_params import SamplingParams
from edgeserve.text.grammar import GrammarState

from .cuda_graphs import DecodeGraphs
from .kv_cache import KVPool, PagedKVAttention
from .sampler import SampleOutput, sample_tokens
from .scheduler import SchedulerOutput


@dataclass
class SamplingRow:
    """What the sampler needs of one sequence that samples this step."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int]
    output_ids: list[int]
    grammar: GrammarState | None = None  # constrained decoding: the mask comes from here


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
    """Owns the model and its KV pool; turns a SchedulerOutput into sampled tokens."""

    def __init__(self, model: LlamaModel, pool: KVPool, graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.pool = pool
        self.device = model.device
        self.graphs = graphs  # decode steps go through these (CUDA graphs) when set; see engine.cuda_graphs

    def execute(self, step: SchedulerOutput, rows: list[SamplingRow], fill: TokenFill | None = None
                ) -> SampleOutput | None:
        """Run the step's tokens; sample one token for each scheduled sequence that reaches its end.

        `rows` lists the sampling sequences in batch order (those with `samples` set); `fill` supplies token ids
        that are still on the device. Returns None when no sequence samples (every one was mid-prefill). The
        result's tensors stay on the device: nothing here waits for the step to finish.
        """
        scheduled = step.scheduled
        if not scheduled:
            return None
        dev = self.device
        query_lens = [s.num_new_tokens for s in scheduled]
        if self.graphs is not None and self.graphs.can_run(query_lens, step.block_tables):
            sample_rows = [i for i, s in enumerate(scheduled) if s.samples]
            if not sample_rows:  # one-token prefill chunks that do not reach their end: nothing to sample
                return self._eager(step, query_lens, [], fill)
            logits = self.graphs.run(step.token_ids, step.positions, step.slot_mapping, step.context_lens,
                                     step.block_tables, fill)
            if len(sample_rows) < len(scheduled):
                logits = logits[to_device(sample_rows, torch.long, dev)]
            return self._sample(logits, rows)
        return self._eager(step, query_lens, rows, fill)

    def _eager(self, step: SchedulerOutput, query_lens: list[int], rows: list[SamplingRow],
               fill: TokenFill | None = None) -> SampleOutput | None:
        scheduled, dev = step.scheduled, self.device
        meta = AttentionMetadata.build(query_lens, step.context_lens, step.block_tables, step.slot_mapping, dev)
        ids = to_device(step.token_ids, torch.long, dev)
        if fill is not None:
            fill.apply(ids)
        positions = to_device(step.positions, torch.long, dev)
        last_rows = [end - 1 for end, s in zip(_cumsum(query_lens), scheduled) if s.samples]
        attn, rows_split = PagedKVAttention(self.pool, meta), _prompt_rows(step, dev)
        if not last_rows:
            self.model.forward(ids, positions, attn, rows_split)
            return None
        hidden = self.model.forward(ids, positions, attn, rows_split)
        logits = self.model.logits(hidden[to_device(last_rows, torch.long, dev)])
        return self._sample(logits, rows)

    @staticmethod
    def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SampleOutput:
        # on a GPU the forward is still running here: the grammar masks are computed on the host meanwhile
        return sample_tokens(logits, [r.params for r in rows], [r.generator for r in rows],
                             [r.prompt_ids for r in rows], [r.output_ids for r in rows], [r.grammar for r in rows])

    def forward_logits(self, step: SchedulerOutput, num_rows: list[int]) -> torch.Tensor:
        """Run the step's tokens; float32 logits of the last `num_rows[i]` rows of each scheduled sequence, stacked
        in batch order ([sum(num_rows), vocab]); speculative verification reads several rows per sequence."""
        scheduled, dev = step.scheduled, self.device
        query_lens = [s.num_new_tokens for s in scheduled]
        meta = AttentionMetadata.build(query_lens, step.context_lens, step.block_tables, step.slot_mapping, dev)
        ids = to_device(step.token_ids, torch.long, dev)
        positions = to_device(step.positions, torch.long, dev)
        hidden = self.model.forward(ids, positions, PagedKVAttention(self.pool, meta), _prompt_rows(step, dev))
        rows = [r for end, n in zip(_cumsum(query_lens), num_rows) for r in range(end - n, end)]
        return self.model.logits(hidden[to_device(rows, torch.long, dev)])


def _prompt_rows(step: SchedulerOutput, device: torch.device) -> PromptRows | None:
    """Which of the step's rows are prompt tokens (None in a step of decodes only)."""
    if all(s.positions[0] >= s.num_prompt_tokens for s in step.scheduled):
        return None
    return PromptRows.build([p < s.num_prompt_tokens for s in step.scheduled for p in s.positions], device)


def _cumsum(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out
