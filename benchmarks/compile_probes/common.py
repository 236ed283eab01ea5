"""What the compile probes share: a decode-only attention over a paged pool passed in as tensors (so torch.compile
sees the pool as an input) and the model's forward + logits as one function of plain tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class DecodeAttn:
    """KVAttention for a decode-only step: every row has one query token; K/V gathered through `kv_slots`."""

    def __init__(self, k, v, slot_mapping, kv_slots, mask):
        self.k, self.v, self.slot_mapping, self.kv_slots, self.mask = k, v, slot_mapping, kv_slots, mask

    def layer_cache(self, i):
        return self.k[i], self.v[i], self.slot_mapping

    def attend(self, i, q):
        hkv, d = self.k.shape[-2:]
        out_dtype, q = q.dtype, q.double()
        k = self.k[i].view(-1, hkv, d)[self.kv_slots].transpose(1, 2).double()
        v = self.v[i].view(-1, hkv, d)[self.kv_slots].transpose(1, 2).double()
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=self.mask, enable_gqa=q.shape[1] != hkv)
        return o.squeeze(2).to(out_dtype).reshape(q.shape[0], -1)


def decode_fn(model):
    """decode(ids, positions, slot_mapping, kv_slots, mask, k, v) -> (logits, hidden) through `model`'s own code."""
    fwd, lg = type(model).forward.__wrapped__, type(model).logits.__wrapped__

    def decode(ids, positions, slot_mapping, kv_slots, mask, k, v):
        h = fwd(model, ids, positions, DecodeAttn(k, v, slot_mapping, kv_slots, mask))
        return lg(model, h), h

    return decode
