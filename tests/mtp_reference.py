"""A reference for Qwen3.5's MTP head computed from an HF checkpoint's `mtp.*` weights (transformers does not run
the MTP block): the fusion (embedding and hidden pre-norms, `mtp.fc` over [embedding | hidden]) and the output norm
and head in plain torch, the block itself as the checkpoint defines it, a full-attention decoder layer of the model's
own class loaded with `mtp.layers.0.*`."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def offset_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's RMSNorm: x / rms(x) * (1 + w), in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())


def mtp_reference_logits(model, folder: Path, ids: list[int], drafts: list[int] = ()) -> torch.Tensor:
    """The MTP head's logits [len(ids) - 1 + len(drafts), vocab]: row i reads token ids[i + 1] and the trunk's
    final-normed hidden state at position i (transformers' `last_hidden_state`), causal attention over rows 0..i; then
    one row per draft, reading the draft token and the head's own normed output of the row before (how it drafts
    further)."""
    from safetensors.torch import load_file

    sd = load_file(folder / "model.safetensors")
    mtp = {k[len("mtp."):]: v.float() for k, v in sd.items() if k.startswith("mtp.")}
    text = model.model.language_model if hasattr(model.model, "language_model") else model.model
    cfg = text.config
    full = json.loads((folder / "config.json").read_text())
    full = full.get("text_config", full)["layer_types"].index("full_attention")
    block = type(text.layers[full])(cfg, full).float().eval()
    block.load_state_dict(_fused_experts({k[len("layers.0."):]: v for k, v in mtp.items()
                                          if k.startswith("layers.0.")}))
    with torch.no_grad():
        x = torch.tensor([ids])
        h = text(input_ids=x).last_hidden_state[0, :-1]
        e = text.embed_tokens(x)[0, 1:]
        g = _head(text, mtp, block, e, h)
        for d in drafts:
            e = torch.cat([e, text.embed_tokens(torch.tensor([d]))])
            h = torch.cat([h, g[-1:]])
            g = _head(text, mtp, block, e, h)
        return model.lm_head(g).float()


def _head(text, mtp: dict[str, torch.Tensor], block, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The head's normed outputs g for embedding rows e and hidden rows h (causal over the rows)."""
    eps = text.config.rms_norm_eps
    fused = torch.cat([offset_rms_norm(e, mtp["pre_fc_norm_embedding.weight"], eps),
                       offset_rms_norm(h, mtp["pre_fc_norm_hidden.weight"], eps)], dim=-1)
    y = fused @ mtp["fc.weight"].T
    t = y.shape[0]
    pos = torch.arange(t)[None]
    cos_sin = text.rotary_emb(y[None], pos[None].expand(3, 1, -1))
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    out = block(y[None], position_embeddings=cos_sin, attention_mask=mask, position_ids=pos)
    out = out[0] if isinstance(out, tuple) else out
    return offset_rms_norm(out[0], mtp["norm.weight"], eps)


def _fused_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layer's per-expert weights (`mlp.experts.{e}.{gate,up,down}_proj.weight`, as the checkpoint stores them)
    as the fused [experts, ...] parameters the transformers MoE module holds."""
    n = len({k.split(".")[2] for k in sd if k.startswith("mlp.experts.")})
    if not n:
        return sd
    out = {k: v for k, v in sd.items() if not k.startswith("mlp.experts.")}
    e = "mlp.experts.{}.{}_proj.weight"
    out["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([sd[e.format(i, "gate")], sd[e.format(i, "up")]])
                                                   for i in range(n)])
    out["mlp.experts.down_proj"] = torch.stack([sd[e.format(i, "down")] for i in range(n)])
    return out
