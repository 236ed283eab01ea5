"""A draft model as proposer: its own paged KV pool and block tables that follow the target's sequences."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgeserve.engine.cache.kv_blocks import BlockManager
from edgeserve.engine.cache.kv_cache import KVPool, forward_batch
from edgeserve.engine.sched.request_state import Sequence
from edgeserve.errors import EdgeserveError
from edgeserve.loaders.tokenizer import Tokenizer
from edgeserve.models.load import LoadedModel
from edgeserve.sampling_params import SamplingParams

from .verify import draw_drafts

_PROBE = "Hello, world! Ünïcödé 123 <|im_start|>user\n  def f(x):\treturn x ** 2  # 日本語"


class DraftMismatchError(EdgeserveError, ValueError):
    """The draft model cannot propose for this target (different tokenizer)."""


def check_same_tokenizer(target: Tokenizer, draft: Tokenizer) -> None:
    """Raise DraftMismatchError unless the two tokenizers map the same text to the same ids and back."""
    tv = target.backend.get_vocab(with_added_tokens=True)
    dv = draft.backend.get_vocab(with_added_tokens=True)
    if tv != dv:
        only = sorted(set(tv.items()) ^ set(dv.items()), key=lambda kv: kv[1])[:1]
        raise DraftMismatchError(
            f"the draft model's tokenizer differs from the target's ({len(dv)} vs {len(tv)} tokens"
            + (f"; e.g. {only[0][0]!r} = id {only[0][1]} in one only" if only else "")
            + "): speculative decoding needs a draft with the target's exact tokenizer")
    for name in ("bos_id", "eos_id", "eot_ids"):
        if getattr(target, name) != getattr(draft, name):
            raise DraftMismatchError(f"the draft model's tokenizer has another {name} ({getattr(draft, name)!r} vs "
                                     f"{getattr(target, name)!r}): speculative decoding needs the target's tokenizer")
    if target.encode(_PROBE) != draft.encode(_PROBE):
        raise DraftMismatchError("the draft model's tokenizer splits text differently from the target's: "
                                 "speculative decoding needs the target's exact tokenizer")


def load_draft_model(name: str | None, target: LoadedModel) -> LoadedModel | None:
    """The draft model `name` (catalog name, .gguf, HF folder) loaded onto the target's device, for whoever
    builds an engine with `speculative="draft"`; None when no name is given."""
    if name is None:
        return None
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    return load_model(resolve(name), device=str(target.model.device))


class DraftProposer:
    """Runs the draft model k times per step over a batch of sequences, sampling each draft token from its
    processed distribution q (the same penalties, temperature and filters as the target's p)."""

    def __init__(self, draft: LoadedModel, target: LoadedModel, num_blocks: int, block_size: int) -> None:
        check_same_tokenizer(target.tokenizer, draft.tokenizer)
        self.model = draft.model
        self.vocab = target.config.vocab_size
        self.max_positions = draft.model.max_positions
        self.pool = KVPool(draft.config, num_blocks, block_size, draft.model.dtype, draft.model.device)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.computed: dict[object, int] = {}  # tokens of each sequence whose draft KV is valid

    def propose(self, seqs: list[Sequence], ks: list[int], params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Up to ks[i] draft tokens for each sequence and the distributions [n_i, V] they were drawn from."""
        bm, dev = self.block_manager, self.model.device
        ks = [max(0, min(k, self.max_positions - s.num_tokens)) for s, k in zip(seqs, ks)]
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for s in seqs:
            self.rollback(s.seq_id, s.num_computed_tokens)  # also catches a preempted (recomputed) sequence
        active = [i for i, k in enumerate(ks) if k > 0]
        deterministic = all(params[i].greedy for i in active)
        for j in range(max(ks, default=0)):
            batch, query_lens, ctx, slots, tables, ids, positions = [], [], [], [], [], [], []
            for i in active:
                seq, sid = seqs[i], seqs[i].seq_id
                start = self.computed.get(sid, 0) if j == 0 else seq.num_tokens + j - 1
                tokens = seq.all_token_ids[start:] if j == 0 else [drafts[i][-1]]
                end = start + len(tokens)
                if not bm.has_seq(sid):
                    if not bm.can_allocate(end):
                        continue
                    bm.allocate(sid, seq.all_token_ids[:end])
                elif not bm.ensure_capacity(sid, end):
                    continue  # the draft pool is full: this sequence proposes what it has
                batch.append(i)
                query_lens.append(len(tokens))
                ctx.append(end)
                slots += bm.slots(sid, start, end)
                tables.append(bm.block_table(sid))
                ids += tokens
                positions += range(start, end)
                self.computed[sid] = end
            if not batch:
                break
            hidden = forward_batch(self.model, self.pool, ids, positions, query_lens, ctx, tables, slots)
            last = torch.cumsum(torch.tensor(query_lens, device=dev), 0) - 1
            logits = self.model.logits(hidden[last])
            logits = _fit_vocab(logits, self.vocab)
            tokens_out, probs = draw_drafts(logits, [seqs[i] for i in batch], [params[i] for i in batch],
                                            [drafts[i] for i in batch], [generators[i] for i in batch], deterministic)
            for r, i in enumerate(batch):
                drafts[i].append(tokens_out[r])
                if probs is not None:
                    qs[i].append(probs[r])
            active = [i for i in batch if len(drafts[i]) < ks[i]]
        return drafts, [torch.stack(q) if q else torch.empty(0, self.vocab) for q in qs]

    def rollback(self, seq_id: object, num_valid: int) -> None:
        """Keep the draft KV of the first `num_valid` tokens only (rejected drafts' blocks go back)."""
        if seq_id not in self.computed:
            return
        keep = min(self.computed[seq_id], num_valid)
        if keep == 0:
            self.free(seq_id)
            return
        self.computed[seq_id] = keep
        self.block_manager.truncate(seq_id, keep)

    def free(self, seq_id: object) -> None:
        """Forget a finished sequence."""
        self.computed.pop(seq_id, None)
        if self.block_manager.has_seq(seq_id):
            self.block_manager.free(seq_id)


def _fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft logits cut or padded (with -inf) to the target's vocabulary width."""
    if logits.shape[-1] >= vocab:
        return logits[:, :vocab]
    return F.pad(logits, (0, vocab - logits.shape[-1]), value=float("-inf"))
