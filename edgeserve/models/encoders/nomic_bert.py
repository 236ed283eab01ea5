"""nomic-bert (nomic-embed-text v1 / v1.5): a post-LayerNorm BERT with a fused QKV projection, rotary positions
(NeoX half-split, over the whole head), a SwiGLU feed-forward and no biases in the attention or MLP.

Weights use BertEncoder's names plus `attention.qkv` (rows: q, k, v) and `intermediate.gate`; the MLP is
`down(silu(gate(x)) * up(x))` (nomic's fc12 is the gate, fc11 the up projection).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgeserve.models.encoders.bert import BertEncoder, additive_mask


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX-style rotary embedding of [.., seq, head_dim] with cos/sin [seq, head_dim / 2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_tables(t: int, head_dim: int, theta: float, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [t, head_dim / 2] for positions 0..t-1 (computed in float32)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    ang = torch.arange(t, device=device, dtype=torch.float32)[:, None] * inv[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


class NomicBertEncoder(BertEncoder):
    """nomic-bert's embeddings + post-LayerNorm rotary layers; forward gives the last hidden states."""

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[batch, seq] ids and 0/1 mask -> [batch, seq, hidden] states (padding positions are garbage)."""
        c = self.cfg
        b, t = input_ids.shape
        x = self._embed(input_ids, token_type_ids)
        mask = additive_mask(attention_mask, x.dtype)
        heads, hd = c.num_heads, c.hidden_size // c.num_heads
        cos, sin = rope_tables(t, hd, c.rope_theta, x.device, x.dtype)
        for i in range(c.num_layers):
            p = f"encoder.layer.{i}"
            qkv = self._lin(x, f"{p}.attention.qkv").view(b, t, 3, heads, hd).permute(2, 0, 3, 1, 4)
            q, k, v = rotate_half(qkv[0], cos, sin), rotate_half(qkv[1], cos, sin), qkv[2]
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            a = self._lin(a.transpose(1, 2).reshape(b, t, c.hidden_size), f"{p}.attention.output.dense")
            x = self._ln(a + x, f"{p}.attention.output.LayerNorm")
            h = F.silu(self._lin(x, f"{p}.intermediate.gate")) * self._lin(x, f"{p}.intermediate.dense")
            x = self._ln(self._lin(h, f"{p}.output.dense") + x, f"{p}.output.LayerNorm")
        return x
