"""A SigLIP vision tower (Gemma 3's, SmolVLM's) written as llama.cpp's converter writes an mmproj GGUF: clip.cpp's
tensor names and `clip.*` keys, the projector's tensors as given."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from support.gguf_writer import add_key, finish

# HF name (after the tower's prefix, without .weight / .bias) -> clip.cpp's
_TOP = {"embeddings.patch_embedding": "v.patch_embd", "embeddings.position_embedding": "v.position_embd",
        "post_layernorm": "v.post_ln"}
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.out_proj": "attn_out", "layer_norm1": "ln1", "layer_norm2": "ln2", "mlp.fc1": "ffn_up",
          "mlp.fc2": "ffn_down"}


def tower_tensors(state: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """The tower's tensors under `prefix` (HF names) by clip.cpp's names (a `.head.` pooling head left out)."""
    out = {}
    for name, t in state.items():
        if not name.startswith(prefix) or ".head." in name:
            continue
        rest, kind = name[len(prefix):].rsplit(".", 1)
        if rest.startswith("encoder.layers."):
            i, sub = rest[len("encoder.layers."):].split(".", 1)
            out[f"v.blk.{i}.{_LAYER[sub]}.{kind}"] = t
        else:
            out[f"{_TOP[rest]}.{kind}"] = t
    return out


def write_mmproj(path: Path, state: dict[str, np.ndarray], prefix: str, vc: Any, projector_type: str,
                 projector: dict[str, np.ndarray], keys: dict[str, Any] | None = None,
                 f16_matrices: bool = False) -> Path:
    """An mmproj of the SigLIP tower at `prefix` in `state` (float32 arrays; vision config `vc`), with the projector
    tensors `projector` (clip.cpp's names) and more `clip.vision.*` `keys`; `f16_matrices`: 2-D tower tensors as F16
    (as the converter's default outtype stores them)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "clip")
    w.add_string("clip.projector_type", projector_type)
    w.add_bool("clip.has_vision_encoder", True)
    vision = {"embedding_length": vc.hidden_size, "feed_forward_length": vc.intermediate_size,
              "block_count": vc.num_hidden_layers, "attention.head_count": vc.num_attention_heads,
              "image_size": vc.image_size, "patch_size": vc.patch_size,
              "attention.layer_norm_epsilon": float(vc.layer_norm_eps), "image_mean": [0.5, 0.5, 0.5],
              "image_std": [0.5, 0.5, 0.5], **(keys or {})}
    for key, value in vision.items():
        add_key(w, f"clip.vision.{key}", value)
    w.add_bool("clip.use_gelu", True)
    for name, t in tower_tensors(state, prefix).items():
        w.add_tensor(name, t.astype(np.float16) if f16_matrices and t.ndim == 2 else t)
    for name, t in projector.items():
        w.add_tensor(name, t)
    finish(w)
    return path
