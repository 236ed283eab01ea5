"""Float64 references for the encoders transformers has no class for (their checkpoints run as remote code, which
nothing here may fetch), written from their published definitions, and random weights under their Hugging Face
names: nomic-bert (nomic-embed-text v1 / v1.5) and jina-bert-v2 (jina-embeddings-v2)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def nomic_state(hidden: int, layers: int, ffn: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under nomic-embed-text's Hugging Face names (no biases in attention / MLP)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    sd = {"embeddings.word_embeddings.weight": r(vocab, hidden),
          "embeddings.token_type_embeddings.weight": r(2, hidden), "emb_ln.weight": 1 + r(hidden),
          "emb_ln.bias": r(hidden)}
    for i in range(layers):
        p = f"encoder.layers.{i}"
        sd.update({f"{p}.attn.Wqkv.weight": r(3 * hidden, hidden), f"{p}.attn.out_proj.weight": r(hidden, hidden),
                   f"{p}.mlp.fc11.weight": r(ffn, hidden), f"{p}.mlp.fc12.weight": r(ffn, hidden),
                   f"{p}.mlp.fc2.weight": r(hidden, ffn), f"{p}.norm1.weight": 1 + r(hidden),
                   f"{p}.norm1.bias": r(hidden), f"{p}.norm2.weight": 1 + r(hidden), f"{p}.norm2.bias": r(hidden)})
    return sd


def nomic_reference(sd: dict[str, torch.Tensor], ids: list[int], heads: int, layers: int, base: float,
                    eps: float) -> torch.Tensor:
    """nomic-bert in float64, written from its published definition (rotary non-interleaved over the whole head,
    SwiGLU with fc12 as the gate, post-LayerNorm), mean-pooled and normalized."""
    w = {k: v.double() for k, v in sd.items()}
    ln = lambda x, n: F.layer_norm(x, x.shape[-1:], w[f"{n}.weight"], w[f"{n}.bias"], eps)  # noqa: E731
    x = ln(w["embeddings.word_embeddings.weight"][ids] + w["embeddings.token_type_embeddings.weight"][0], "emb_ln")
    t, d = x.shape
    hd = d // heads
    freqs = [[p / base ** (2 * j / hd) for j in range(hd // 2)] for p in range(t)]
    cos, sin = torch.tensor(freqs, dtype=torch.float64).cos(), torch.tensor(freqs, dtype=torch.float64).sin()

    def rot(v: torch.Tensor) -> torch.Tensor:  # [heads, t, hd]
        a, b = v[..., : hd // 2], v[..., hd // 2:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)

    for i in range(layers):
        p = f"encoder.layers.{i}"
        q, k, v = (x @ w[f"{p}.attn.Wqkv.weight"].T).view(t, 3, heads, hd).permute(1, 2, 0, 3)
        att = torch.softmax(rot(q) @ rot(k).transpose(-1, -2) / math.sqrt(hd), -1) @ v
        x = ln(x + att.transpose(0, 1).reshape(t, d) @ w[f"{p}.attn.out_proj.weight"].T, f"{p}.norm1")
        y = (x @ w[f"{p}.mlp.fc11.weight"].T) * F.silu(x @ w[f"{p}.mlp.fc12.weight"].T)
        x = ln(x + y @ w[f"{p}.mlp.fc2.weight"].T, f"{p}.norm2")
    return F.normalize(x.mean(0), dim=-1)


def jina_state(hidden: int, layers: int, ffn: int, vocab: int, fused: bool, qk_norm: bool) -> dict[str, torch.Tensor]:
    """Random jina-bert-v2 weights under the Hugging Face names llama.cpp's converter maps (the GLU's gate and up
    halves split as `gated_layers_w` / `_v`, or fused as `up_gated_layer`, gate rows first)."""
    g = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    sd = {"embeddings.word_embeddings.weight": r(vocab, hidden), "embeddings.token_type_embeddings.weight":
          r(2, hidden), "embeddings.LayerNorm.weight": 1 + r(hidden), "embeddings.LayerNorm.bias": r(hidden)}
    for i in range(layers):
        p = f"encoder.layer.{i}"
        for n in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            sd.update({f"{p}.{n}.weight": r(hidden, hidden), f"{p}.{n}.bias": r(hidden)})
        for n in ("attention.output.LayerNorm", "mlp.layernorm") + (
                ("attention.self.layer_norm_q", "attention.self.layer_norm_k") if qk_norm else ()):
            sd.update({f"{p}.{n}.weight": 1 + r(hidden), f"{p}.{n}.bias": r(hidden)})
        gate, up = r(ffn, hidden), r(ffn, hidden)
        if fused:
            sd[f"{p}.mlp.up_gated_layer.weight"] = torch.cat([gate, up])
        else:
            sd.update({f"{p}.mlp.gated_layers_w.weight": gate, f"{p}.mlp.gated_layers_v.weight": up})
        sd.update({f"{p}.mlp.wo.weight": r(hidden, ffn), f"{p}.mlp.wo.bias": r(hidden)})
    return sd


def paper_slopes(n: int) -> list[float]:
    """ALiBi's head slopes as its paper defines them (a geometric series from 2^(-8/n); for a head count that is no
    power of two, every other slope of twice the nearest power of two fills the rest)."""
    if math.log2(n).is_integer():
        return [2 ** (-8 / n * (i + 1)) for i in range(n)]
    c = 2 ** math.floor(math.log2(n))
    return paper_slopes(c) + paper_slopes(2 * c)[0::2][: n - c]


def jina_reference(sd: dict[str, torch.Tensor], ids: list[int], heads: int, layers: int, ffn: int,
                   eps: float) -> torch.Tensor:
    """jina-bert-v2 in float64, written from its published definition (JinaBert: symmetric ALiBi -m_h * |i - j|
    added to the scaled scores, no position embeddings, post-LayerNorm, GEGLU `wo(gelu(gate) * up)`), mean-pooled
    and normalized."""
    w = {k: v.double() for k, v in sd.items()}
    ln = lambda x, n: F.layer_norm(x, x.shape[-1:], w[f"{n}.weight"], w[f"{n}.bias"], eps)  # noqa: E731
    lin = lambda x, n: x @ w[f"{n}.weight"].T + w.get(f"{n}.bias", 0)  # noqa: E731
    x = ln(w["embeddings.word_embeddings.weight"][ids] + w["embeddings.token_type_embeddings.weight"][0],
           "embeddings.LayerNorm")
    t, d = x.shape
    hd = d // heads
    pos = torch.arange(t, dtype=torch.float64)
    alibi = -torch.tensor(paper_slopes(heads), dtype=torch.float64)[:, None, None] * (pos[:, None] - pos).abs()
    for i in range(layers):
        p = f"encoder.layer.{i}"
        q, k = lin(x, f"{p}.attention.self.query"), lin(x, f"{p}.attention.self.key")
        if f"{p}.attention.self.layer_norm_q.weight" in w:
            q, k = ln(q, f"{p}.attention.self.layer_norm_q"), ln(k, f"{p}.attention.self.layer_norm_k")
        q, k, v = (y.view(t, heads, hd).transpose(0, 1) for y in (q, k, lin(x, f"{p}.attention.self.value")))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + alibi, -1) @ v
        h = ln(x + lin(att.transpose(0, 1).reshape(t, d), f"{p}.attention.output.dense"),
               f"{p}.attention.output.LayerNorm")
        gu = (h @ w[f"{p}.mlp.up_gated_layer.weight"].T if f"{p}.mlp.up_gated_layer.weight" in w else
              torch.cat([h @ w[f"{p}.mlp.gated_layers_w.weight"].T, h @ w[f"{p}.mlp.gated_layers_v.weight"].T], -1))
        x = ln(h + lin(F.gelu(gu[:, :ffn]) * gu[:, ffn:], f"{p}.mlp.wo"), f"{p}.mlp.layernorm")
    return F.normalize(x.mean(0), dim=-1)
