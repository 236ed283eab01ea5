"""What a quantized KV cache costs in quality: next-token KL divergence and top-1 agreement of a model reading its
K/V in one KV format against the same model reading them in another, over one fixed text.

The text is prefilled in chunks (as the engine does), so every position attends to K/V that went through the
format; each chunk's logits are compared position by position and only running sums are kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgeserve.engine.cache.kv_cache import KVPool, forward_batch
from edgeserve.engine.cache.kv_format import FP8, KVFormat, as_kv_format, resolve_kv_format


@dataclass
class KVDivergence:
    """KL(reference || candidate) of the next-token distributions over `positions` positions: mean and max, the
    share of positions whose top-1 token agrees."""

    positions: int
    mean_kl: float
    max_kl: float
    top1_agreement: float


def _chunk_logits(model, pool: KVPool, ids: list[int], chunk: int, block_size: int):
    """The logits of each prefill chunk of `ids` over `pool` (one sequence owning blocks 0, 1, ...)."""
    table = list(range(-(-len(ids) // block_size)))
    for start in range(0, len(ids), chunk):
        piece = ids[start: start + chunk]
        positions = list(range(start, start + len(piece)))
        slots = [table[p // block_size] * block_size + p % block_size for p in positions]
        hidden = forward_batch(model, pool, piece, positions, [len(piece)], [start + len(piece)], [table], slots)
        yield model.logits(hidden).float()


def _format(name: str, lm) -> KVFormat:
    """A `--kv-cache-dtype` name's format for `lm`, or "f32": float32 K/V (a reference finer than bf16). "fp8" is
    the format wherever the model runs: off the Triton path the torch twins write and read it (slowly), which is
    enough to measure what the format costs."""
    if name == "f32":
        return as_kv_format(torch.float32)
    if name == "fp8":
        return FP8
    return resolve_kv_format(name, lm.config, lm.model.dtype, lm.model.device)


@torch.inference_mode()
def kv_divergence(lm, ids: list[int], candidate: str = "q8_0", reference: str = "auto", chunk: int = 256,
                  block_size: int = 16) -> KVDivergence:
    """Next-token KL divergence and top-1 agreement of `lm` over `ids` with its KV cache in `candidate` against
    `reference` (`--kv-cache-dtype` names, or "f32")."""
    model = lm.model
    blocks = -(-len(ids) // block_size)
    pools = [KVPool(lm.config, blocks, block_size, _format(name, lm), model.device) for name in (reference, candidate)]
    n, kl_sum, kl_max, agree = 0, 0.0, 0.0, 0
    for ref, cand in zip(_chunk_logits(model, pools[0], ids, chunk, block_size),
                         _chunk_logits(model, pools[1], ids, chunk, block_size)):
        lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(cand.double(), -1)
        kl = (lp.exp() * (lp - lq)).sum(-1)
        n += kl.numel()
        kl_sum += kl.sum().item()
        kl_max = max(kl_max, kl.max().item())
        agree += (ref.argmax(-1) == cand.argmax(-1)).sum().item()
    return KVDivergence(n, kl_sum / n, kl_max, agree / n)
