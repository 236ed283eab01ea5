"""A Gemma 4 assistant as proposer (models.archs.gemma4_assistant): k drafts per step from the target's last hidden
state, over the target's own K/V. It keeps no K/V of its own.

A sequence of n tokens whose target K/V holds positions 0..n-2 drafts from (token x_{n-1}, the target's hidden h at
position n-2, which predicted it): every draft of the round sits at position n - 1 and reads the same K/V; each
further draft reads (the previous draft, the assistant's own next h). `observe` keeps each sequence's last hidden
rows of a step, so the row at n - 2 is there after a prefill or a verification (whatever was accepted). A sliding
layer sees the target's last window - 1 keys before the draft's position, as the target's own next token does
(llama.cpp's mask; transformers' reference sees one older key once the context passes the window, a key the
target's window pool may have handed back already).
"""

from __future__ import annotations

from typing import Callable

import torch

from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention
from edgeserve.engine.sched.request_state import Sequence
from edgeserve.engine.sched.scheduler import ScheduledSeq
from edgeserve.kernels.dispatch import AttentionMetadata
from edgeserve.kernels.transfer import to_device
from edgeserve.models.archs.gemma4_assistant.model import target_layers, target_mismatch
from edgeserve.models.load import LoadedModel
from edgeserve.sampling_params import SamplingParams

from .draft import DraftMismatchError
from .verify import draw_drafts, one_hot

KEEP_ROWS = 17  # hidden rows kept per sequence: a verification's k + 1 (k <= 16)


def is_assistant(model: LoadedModel | None) -> bool:
    """Whether a loaded draft model is a Gemma 4 assistant (it drafts over the target's K/V)."""
    return model is not None and model.config.backbone_hidden_size > 0


class TargetKV:
    """The assistant's KVAttention for one drafting step: its layer i reads the target layer `sources[i]`'s K/V
    through `attn` (the target's pool; metadata whose query rows are the last of each context), writing nothing."""

    def __init__(self, attn: PagedKVAttention, sources: list[int]) -> None:
        self.attn = attn
        self.sources = sources

    def layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.attn.layer_cache(self.sources[layer])

    def attend(self, layer: int, q: torch.Tensor, window: int | None = None, softcap: float | None = None,
               scale: float | None = None, sinks: torch.Tensor | None = None, spans: bool = True) -> torch.Tensor:
        # the query row stands at position n - 2 of the metadata (its context's last): window - 1 keys there are the
        # window - 1 keys before the draft's own position n - 1
        return self.attn.attend(self.sources[layer], q, None if window is None else window - 1, softcap, scale,
                                sinks, spans=False)


class AssistantProposer:
    """Drafts with a Gemma 4 assistant over a batch of sequences, sampling each draft from its processed distribution
    q (the target's penalties, temperature and filters), as DraftProposer does. `attach` gives it the target's pool
    and block manager (the engine's)."""

    needs_hidden = True

    def __init__(self, draft: LoadedModel, target: LoadedModel) -> None:
        why = target_mismatch(draft.config, target.config)
        if why is not None:
            raise DraftMismatchError(f"--draft {draft.name}: {why}")
        self.model = draft.model
        self.target = target.model
        self.vocab = target.config.vocab_size
        kinds = target_layers(target.config)
        self.sources = [kinds[draft.config.is_global(i)] for i in range(draft.config.num_layers)]
        self.pool: KVPool | None = None
        self.block_manager = None
        self.rows: dict[object, tuple[int, torch.Tensor]] = {}  # seq -> (first position, target hidden rows)
        # benchmarks only: (sequence, the assistant's drafts) -> the drafts to propose instead (point masses)
        self.oracle: Callable[[Sequence, list[int]], list[int]] | None = None

    def attach(self, pool: KVPool, block_manager) -> None:
        """The target's KV pool and the scheduler's BlockManager (its block tables)."""
        self.pool, self.block_manager = pool, block_manager

    def observe(self, scheduled: list[ScheduledSeq], hidden: torch.Tensor, seqs: dict[object, Sequence]) -> None:
        """Keep the last hidden rows [<= KEEP_ROWS, hidden] of each sequence in `seqs` from a step's rows (in
        `scheduled`'s order)."""
        row = 0
        for s in scheduled:
            n = s.num_new_tokens
            if s.seq_id in seqs and n:
                keep = min(n, KEEP_ROWS)
                self.rows[s.seq_id] = (s.positions[0] + n - keep, hidden[row + n - keep: row + n].clone())
            row += n

    def _ready(self, seq: Sequence) -> torch.Tensor | None:
        """The target's hidden row at position n - 2 of a sequence of n tokens whose K/V holds positions 0..n-2
        and whose last token is known, else None (it drafts nothing this step)."""
        n = seq.num_tokens
        kept = self.rows.get(seq.seq_id)
        if (kept is None or n < 2 or seq.num_computed_tokens != n - 1 or seq.all_token_ids[-1] < 0
                or self.block_manager is None or not self.block_manager.has_seq(seq.seq_id)):
            return None
        start, rows = kept
        return rows[n - 2 - start] if 0 <= n - 2 - start < rows.shape[0] else None

    def _view(self, seqs: list[Sequence]) -> TargetKV:
        """The target's K/V of positions 0..n-2 of each sequence, one query row each."""
        bm, dev = self.block_manager, self.target.device
        meta = AttentionMetadata.build([1] * len(seqs), [s.num_tokens - 1 for s in seqs],
                                       [bm.block_table(s.seq_id) for s in seqs],
                                       [bm.slot(s.seq_id, s.num_tokens - 2) for s in seqs], dev)
        return TargetKV(PagedKVAttention(self.pool, meta), self.sources)  # type: ignore[arg-type]

    def propose(self, seqs: list[Sequence], ks: list[int], params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Up to ks[i] draft tokens for each sequence and the distributions [n_i, V] they were drawn from."""
        ks = [max(0, min(k, self.model.max_positions - s.num_tokens)) for s, k in zip(seqs, ks)]
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        ready = {i: h for i, s in enumerate(seqs) if ks[i] > 0 and (h := self._ready(s)) is not None}
        active = list(ready)
        if active:
            self._draft(seqs, ks, params, generators, active, torch.stack([ready[i] for i in active]), drafts, qs)
        if self.oracle is not None:
            drafts = [self.oracle(s, d) if d else d for s, d in zip(seqs, drafts)]
            qs = [list(one_hot(d, self.vocab, self.target.device)) for d in drafts]
        return drafts, [torch.stack(q) if q else torch.empty(0, self.vocab) for q in qs]

    def _draft(self, seqs: list[Sequence], ks: list[int], params: list[SamplingParams],
               generators: list[torch.Generator | None], active: list[int], h: torch.Tensor,
               drafts: list[list[int]], qs: list[list[torch.Tensor]]) -> None:
        """Draft rounds for the `active` sequences from their target hidden rows `h`, into `drafts` / `qs`."""
        dev, target = self.target.device, self.target
        deterministic = all(params[i].greedy for i in active)
        tokens = [seqs[i].all_token_ids[-1] for i in active]
        view = self._view([seqs[i] for i in active])
        positions = to_device([seqs[i].num_tokens - 1 for i in active], torch.long, dev)
        while active:
            embeds = target.embed_rows(to_device(tokens, torch.long, dev)) * target.embed_scale
            logits, h = self.model.draft(embeds, h, positions, view)
            tokens, probs = draw_drafts(logits[:, : self.vocab], [seqs[i] for i in active],
                                        [params[i] for i in active], [drafts[i] for i in active],
                                        [generators[i] for i in active], deterministic)
            for r, i in enumerate(active):
                drafts[i].append(tokens[r])
                if probs is not None:
                    qs[i].append(probs[r])
            keep = [r for r, i in enumerate(active) if len(drafts[i]) < ks[i]]
            if len(keep) < len(active) and keep:
                view = self._view([seqs[active[r]] for r in keep])
                positions, h = positions[keep], h[keep]
            active, tokens = [active[r] for r in keep], [tokens[r] for r in keep]

    def rollback(self, seq_id: object, num_valid: int) -> None:
        """Nothing to roll back: the assistant keeps no K/V (the target's rejected rows go with the target's)."""

    def free(self, seq_id: object) -> None:
        """Forget a finished or preempted sequence."""
        self.rows.pop(seq_id, None)
