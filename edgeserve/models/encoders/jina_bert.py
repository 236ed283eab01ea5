"""jina-bert-v2 (jina-embeddings-v2 small / base): a post-LayerNorm BERT without position embeddings, whose
attention is biased by symmetric ALiBi (-slope_h * |i - j|, the slopes of the ALiBi paper with a maximum bias of 8,
as llama.cpp sets it), with a GEGLU feed-forward `down(gelu(gate(x)) * up(x))`.

Weights use BertEncoder's names plus `intermediate.gate` (llama.cpp's `ffn_gate`); a file whose `ffn_up` holds
both halves (rows: gate, then up, as the newer converter keeps `up_gated_layer`) is split on load. Optional per
layer, as llama.cpp reads them: a LayerNorm over the whole query and key projections (`attention.self.q_norm` /
`k_norm`) and a second attention LayerNorm (`attention.output.LayerNorm2`) applied after re-adding the layer input.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from edgeserve.kernels.formats.bf16_weight import Bf16Weight
from edgeserve.models.encoders.bert import BertEncoder, EncoderConfig

MAX_ALIBI_BIAS = 8.0
_MASK_BYTES = 256 << 20  # the most an attention-bias block may take; longer inputs attend in query blocks


def alibi_slopes(heads: int, max_bias: float = MAX_ALIBI_BIAS) -> torch.Tensor:
    """ALiBi's per-head slopes [heads] (float32): geometric for the nearest power of two, then the odd powers of
    the next one's ratio for the rest."""
    n = 1 << int(math.floor(math.log2(heads)))
    m0, m1 = 2.0 ** (-max_bias / n), 2.0 ** (-(max_bias / 2.0) / n)
    return torch.tensor([m0 ** (h + 1) if h < n else m1 ** (2 * (h - n) + 1) for h in range(heads)],
                        dtype=torch.float32)


def split_fused_up(cfg: EncoderConfig, weights: dict[str, torch.Tensor]) -> None:
    """Split each layer's fused `intermediate.dense` [2 * ffn, hidden] (gate rows first) into gate and up."""
    for i in range(cfg.num_layers):
        p = f"encoder.layer.{i}.intermediate"
        up = weights.get(f"{p}.dense.weight")
        if f"{p}.gate.weight" in weights or up is None or up.shape[0] != 2 * cfg.intermediate_size:
            continue
        if isinstance(up, Bf16Weight):  # a 16-bit matrix on the native bfloat16 kernel: two of them
            gate, dense = (Bf16Weight(h, up.lib) for h in up.dequantize().chunk(2, dim=0))
        else:
            if not isinstance(up, torch.Tensor):  # a native block weight: its rows are interleaved, split the floats
                up = up.dequantize().to(weights["embeddings.LayerNorm.weight"].dtype)
            gate, dense = up.chunk(2, dim=0)
        weights[f"{p}.gate.weight"], weights[f"{p}.dense.weight"] = gate, dense
        bias = weights.get(f"{p}.dense.bias")
        if bias is not None:
            weights[f"{p}.gate.bias"], weights[f"{p}.dense.bias"] = bias.chunk(2, dim=0)


class JinaBertEncoder(BertEncoder):
    """jina-bert-v2's embeddings + post-LayerNorm ALiBi layers; forward gives the last hidden states."""

    fuses_qkv = False  # its forward reads query / key / value (and their optional norms) apart

    def __init__(self, cfg: EncoderConfig, weights: dict[str, torch.Tensor]) -> None:
        split_fused_up(cfg, weights)
        super().__init__(cfg, weights)
        self.slopes = alibi_slopes(cfg.num_heads)

    def _bias(self, attention_mask: torch.Tensor, rows: slice, dtype: torch.dtype) -> torch.Tensor:
        """[batch, heads, len(rows), seq] attention bias: ALiBi by distance, -inf on padded keys."""
        t = attention_mask.shape[1]
        pos = torch.arange(t, device=attention_mask.device)
        dist = (pos[rows, None] - pos[None, :]).abs().to(torch.float32)
        bias = -self.slopes.to(attention_mask.device)[:, None, None] * dist  # [heads, rows, seq]
        bias = bias[None].masked_fill(attention_mask[:, None, None, :] == 0, float("-inf"))
        return bias.to(dtype)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ALiBi attention of [batch, heads, seq, head_dim] q/k/v, in query blocks that bound the bias's size."""
        b, h, t, _ = q.shape
        block = max(1, min(t, _MASK_BYTES // max(1, b * h * t * q.element_size())))
        out = [F.scaled_dot_product_attention(q[:, :, s:s + block], k, v,
                                              attn_mask=self._bias(mask, slice(s, s + block), q.dtype))
               for s in range(0, t, block)]
        return out[0] if len(out) == 1 else torch.cat(out, dim=2)

    def _norm_if(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self._ln(x, name) if f"{name}.weight" in self.w else x

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[batch, seq] ids and 0/1 mask -> [batch, seq, hidden] states (padding positions are garbage)."""
        c, w = self.cfg, self.w
        b, t = input_ids.shape
        x = self._embed(input_ids, token_type_ids)
        heads, hd = c.num_heads, c.hidden_size // c.num_heads
        for i in range(c.num_layers):
            p = f"encoder.layer.{i}"
            q = self._norm_if(self._lin(x, f"{p}.attention.self.query"), f"{p}.attention.self.q_norm")
            k = self._norm_if(self._lin(x, f"{p}.attention.self.key"), f"{p}.attention.self.k_norm")
            q, k, v = (y.view(b, t, heads, hd).transpose(1, 2)
                       for y in (q, k, self._lin(x, f"{p}.attention.self.value")))
            a = self._attend(q, k, v, attention_mask)
            a = self._lin(a.transpose(1, 2).reshape(b, t, c.hidden_size), f"{p}.attention.output.dense")
            h = self._ln(a + x, f"{p}.attention.output.LayerNorm")
            if f"{p}.attention.output.LayerNorm2.weight" in w:
                h = self._ln(h + x, f"{p}.attention.output.LayerNorm2")
            y = self.act(self._lin(h, f"{p}.intermediate.gate")) * self._lin(h, f"{p}.intermediate.dense")
            x = self._ln(self._lin(y, f"{p}.output.dense") + h, f"{p}.output.LayerNorm")
        return x
