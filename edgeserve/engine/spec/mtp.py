"""The target's own MTP head as proposer (Qwen3.5 / 3.6: models.mtp_head): k drafts per step from the trunk's last
hidden state, with the head's K/V in a one-layer paged pool of its own.

The head at position i reads (token x_{i+1}, trunk hidden h_i). Its K/V row for position i is kept once both are
final: the trunk's step gave h_i (`observe` takes every scheduled row's hidden state) and x_{i+1} is a token of the
sequence. Rows whose next token is not known yet (the last computed position, verified drafts) wait as `pending`
hidden rows. `propose` first runs the pending rows whose next token is now known (a prompt's chunks run during
prefill already, as soon as EAGER_ROWS rows wait), which ends at position n - 2 of a sequence of n tokens: its
output g gives the first draft; each further draft reads (previous draft, previous g) one position on. Those
speculative rows are dropped from the head's K/V right after drafting (the trunk's hidden states replace them once
it has verified).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from edgeserve.engine.cache.kv_blocks import BlockManager
from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention
from edgeserve.engine.sched.request_state import Sequence
from edgeserve.engine.sched.scheduler import ScheduledSeq
from edgeserve.errors import EdgeserveError
from edgeserve.kernels.dispatch import AttentionMetadata
from edgeserve.kernels.transfer import to_device
from edgeserve.models.load import LoadedModel
from edgeserve.models.mtp_head import draft_logits, draft_vocab, full_logits, mtp_forward, mtp_logits
from edgeserve.sampling_params import SamplingParams

from .verify import draw_drafts, one_hot


EAGER_ROWS = 16  # hidden rows a sequence may keep waiting between drafts before the head runs over them


class NoMtpHeadError(EdgeserveError, ValueError):
    """Speculation with `mtp` was asked of a model that has no MTP head."""


def mtp_head_error(target: LoadedModel) -> str | None:
    """Why `target` cannot draft with an MTP head (one line), or None when it can."""
    model = target.model
    if getattr(model, "mtp", None) is not None:
        return None
    why = getattr(model, "mtp_error", None)
    arch = target.config.architecture
    if why:
        return f"--speculative mtp: the MTP block of this {arch} model cannot be read ({why})"
    return (f"--speculative mtp: this {arch} model has no MTP head (only Qwen3.5 / 3.6 files converted with their "
            "MTP block have one); use --speculative ngram or draft, or leave it at auto")


@dataclass
class _HeadSeq:
    """One sequence's head state: K/V of positions base..end-1, then trunk hidden rows from position `end` on that
    are not in it yet."""

    base: int
    end: int
    pending: torch.Tensor | None = None

    @property
    def pending_end(self) -> int:
        return self.end + (0 if self.pending is None else self.pending.shape[0])


class MtpProposer:
    """Drafts with the target's MTP head over a batch of sequences, sampling each draft from its processed
    distribution q (the target's penalties, temperature and filters), as `DraftProposer` does."""

    def __init__(self, target: LoadedModel, num_blocks: int, block_size: int, draft_vocab_size: int = 0) -> None:
        why = mtp_head_error(target)
        if why is not None:
            raise NoMtpHeadError(why)
        self.model = target.model
        self.head = target.model.mtp
        self.vocab = target.config.vocab_size
        # the head drafts within the lowest `draft_vocab_size` token ids (None: the whole vocabulary)
        self.draft_vocab = draft_vocab(self.model, self.head, draft_vocab_size)
        self.pool = KVPool(self.head.kv_config, num_blocks, block_size, self.model.dtype, self.model.device)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.seqs: dict[object, _HeadSeq] = {}
        # benchmarks only: (sequence, the head's drafts) -> the drafts to propose instead (point masses), so that a
        # benchmark can force an acceptance rate on random weights; the head still runs, so the cost is the real one
        self.oracle: Callable[[Sequence, list[int]], list[int]] | None = None

    # --- the trunk's hidden states -----------------------------------------

    def observe(self, scheduled: list[ScheduledSeq], hidden: torch.Tensor, seqs: dict[object, Sequence]) -> None:
        """Take the trunk's hidden rows [T, hidden] of a step (in `scheduled`'s order) for the sequences in `seqs`,
        and run the head over those whose next token is already known where EAGER_ROWS or more wait (a prompt's
        chunks; a paused request's decodes): the rest wait for the next `propose`."""
        row = 0
        for s in scheduled:
            n = s.num_new_tokens
            if s.seq_id in seqs:
                self._take(s.seq_id, s.positions[0], hidden[row: row + n].clone())
            row += n
        self._advance([seqs[s.seq_id] for s in scheduled if s.seq_id in seqs
                       and self.seqs[s.seq_id].pending_end - self.seqs[s.seq_id].end >= EAGER_ROWS])

    def _take(self, seq_id: object, start: int, rows: torch.Tensor) -> None:
        st = self.seqs.get(seq_id)
        if st is None or start < st.base or start > st.pending_end:  # new, or a gap (a prefix-cache hit, a restart)
            self.free(seq_id)
            self.seqs[seq_id] = _HeadSeq(start, start, rows)
            return
        if start < st.end:  # positions computed again (a hybrid's accepted tokens after a partly rejected step):
            rows, start = rows[st.end - start:], st.end  # their tokens are final, the head has them already
            if not rows.shape[0]:
                return
        keep = None if st.pending is None else st.pending[: start - st.end]
        st.pending = rows if keep is None or not keep.shape[0] else torch.cat([keep, rows])

    def _advance(self, seqs: list[Sequence]) -> dict[object, torch.Tensor]:
        """Run the head over each sequence's pending rows whose next token is known; the head's output g at the last
        row run for the sequences that reached position num_tokens - 2 (ready to draft)."""
        bm, batch = self.block_manager, []
        for seq in seqs:
            st = self.seqs.get(seq.seq_id)
            if st is None or st.pending is None:
                continue
            tokens = seq.all_token_ids[st.end + 1: st.pending_end + 1]
            n = next((j for j, t in enumerate(tokens) if t < 0), len(tokens))  # a placeholder id: not known yet
            if n == 0:
                continue
            end = st.end + n - st.base
            if not (bm.ensure_capacity(seq.seq_id, end) if bm.has_seq(seq.seq_id) else bm.can_allocate(end)):
                self.free(seq.seq_id)  # the head's pool is full: this sequence drafts nothing for now
                continue
            if not bm.has_seq(seq.seq_id):
                bm.allocate(seq.seq_id, [0] * end)
            batch.append((seq, st, tokens[:n]))
        if not batch:
            return {}
        g = self._run([(seq.seq_id, st.end, toks) for seq, st, toks in batch],
                      torch.cat([st.pending[: len(toks)] for _, st, toks in batch]))
        out, row = {}, 0
        for seq, st, toks in batch:
            row += len(toks)
            st.end += len(toks)
            st.pending = st.pending[len(toks):] if st.pending.shape[0] > len(toks) else None
            if st.end == seq.num_tokens - 1:
                out[seq.seq_id] = g[row - 1: row]
        return out

    def _run(self, rows: list[tuple[object, int, list[int]]], hidden: torch.Tensor) -> torch.Tensor:
        """The head over a ragged batch: per sequence (id, first position, next tokens), their trunk (or head)
        hidden rows stacked in `hidden`; its outputs g [T, hidden]. Blocks must already cover the rows."""
        bm = self.block_manager
        ids, positions, query_lens, ctx, tables, slots = [], [], [], [], [], []
        for seq_id, start, tokens in rows:
            base = self.seqs[seq_id].base
            ids += tokens
            positions += range(start, start + len(tokens))
            query_lens.append(len(tokens))
            ctx.append(start + len(tokens) - base)
            tables.append(bm.block_table(seq_id))
            slots += bm.slots(seq_id, start - base, start + len(tokens) - base)
        dev = self.model.device
        meta = AttentionMetadata.build(query_lens, ctx, tables, slots, dev)
        return mtp_forward(self.model, self.head, to_device(ids, torch.long, dev), hidden,
                           to_device(positions, torch.long, dev), PagedKVAttention(self.pool, meta))

    # --- drafting ------------------------------------------------------------

    def propose(self, seqs: list[Sequence], ks: list[int], params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Up to ks[i] draft tokens for each sequence and the distributions [n_i, V] they were drawn from."""
        ks = [max(0, min(k, self.model.max_positions - s.num_tokens)) for s, k in zip(seqs, ks)]
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        ready = self._advance([s for s, k in zip(seqs, ks) if k > 0])
        active = [i for i, s in enumerate(seqs) if ks[i] > 0 and s.seq_id in ready]
        if not active:
            return drafts, [torch.empty(0, self.vocab) for _ in seqs]
        g = torch.cat([ready[seqs[i].seq_id] for i in active])
        deterministic = all(params[i].greedy for i in active)
        for j in range(max(ks[i] for i in active)):
            if j:  # one more row per sequence: (its last draft, the head's last output) one position on
                g = self._draft_row([seqs[i] for i in active], [drafts[i][-1] for i in active], g, j)
                if g is None:
                    break
            tokens, probs = self._draw(g, [seqs[i] for i in active], [params[i] for i in active],
                                       [drafts[i] for i in active], [generators[i] for i in active], deterministic)
            for r, i in enumerate(active):
                drafts[i].append(tokens[r])
                if probs is not None:
                    qs[i].append(probs[r])
            keep = [r for r, i in enumerate(active) if len(drafts[i]) < ks[i]]
            active, g = [active[r] for r in keep], g[keep]
            if not active:
                break
        for s in seqs:  # the speculative rows' K/V go: the trunk's hidden states will give the real ones
            st = self.seqs.get(s.seq_id)
            if st is not None and self.block_manager.has_seq(s.seq_id):
                self._truncate(s.seq_id, st, st.end)
        if self.oracle is not None:
            drafts = [self.oracle(s, d) if d else d for s, d in zip(seqs, drafts)]
            qs = [list(one_hot(d, self.vocab, self.model.device)) for d in drafts]
        return drafts, [torch.stack(q) if q else torch.empty(0, self.vocab) for q in qs]

    def _draw(self, g: torch.Tensor, seqs: list[Sequence], params: list[SamplingParams], drafts: list[list[int]],
              generators: list[torch.Generator | None], deterministic: bool) -> tuple[list[int], torch.Tensor | None]:
        """draw_drafts over the head's logits for its output rows g: within the draft vocabulary where there is one
        (a greedy row's argmax there, mapped back to its token id; otherwise its distribution over the whole vocabulary
        with q = 0 outside the draft vocabulary, as rejection sampling reads it)."""
        dv = self.draft_vocab
        if dv is None:
            logits = mtp_logits(self.model, self.head, g)[:, : self.vocab]
        else:
            logits = draft_logits(dv, g)
            if deterministic and not any(p.penalized or p.logit_bias for p in params):
                return dv.ids[logits.argmax(-1)].tolist(), None
            logits = full_logits(dv, logits, self.vocab)
        return draw_drafts(logits, seqs, params, drafts, generators, deterministic)

    def _draft_row(self, seqs: list[Sequence], tokens: list[int], g: torch.Tensor, j: int) -> torch.Tensor | None:
        """The head's outputs for draft j + 1 of each sequence: (draft j, its g) at position num_tokens - 2 + j."""
        bm, rows = self.block_manager, []
        for seq, t in zip(seqs, tokens):
            st = self.seqs[seq.seq_id]
            start = st.end - 1 + j
            if not bm.ensure_capacity(seq.seq_id, start + 1 - st.base):
                return None  # the head's pool is full: draft no further this step
            rows.append((seq.seq_id, start, [t]))
        return self._run(rows, g)

    # --- bookkeeping -------------------------------------------------------------

    def _truncate(self, seq_id: object, st: _HeadSeq, end: int) -> None:
        """Keep the head's K/V of positions before `end` only."""
        st.end = end
        if end <= st.base:
            if self.block_manager.has_seq(seq_id):
                self.block_manager.free(seq_id)
            return
        if self.block_manager.has_seq(seq_id):
            self.block_manager.truncate(seq_id, end - st.base)

    def rollback(self, seq_id: object, num_valid: int) -> None:
        """After verification: keep what was computed from the first `num_valid` positions' trunk hidden states."""
        st = self.seqs.get(seq_id)
        if st is None:
            return
        if st.end > num_valid:
            self._truncate(seq_id, st, num_valid)
            st.pending = None
        elif st.pending is not None:
            st.pending = st.pending[: num_valid - st.end] if num_valid > st.end else None
        if st.pending is not None and not st.pending.shape[0]:
            st.pending = None
        if st.pending is None and st.end <= st.base:
            self.free(seq_id)

    def free(self, seq_id: object) -> None:
        """Forget a finished or preempted sequence."""
        self.seqs.pop(seq_id, None)
        if self.block_manager.has_seq(seq_id):
            self.block_manager.free(seq_id)


