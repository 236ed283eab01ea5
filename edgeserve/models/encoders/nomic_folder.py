"""nomic-bert (nomic-embed-text v1 / v1.5) from a Hugging Face folder: the published checkpoint's config.json
(`n_embd`, `n_layer`, `rotary_emb_base`, ...) and tensor names (`encoder.layers.N.attn.Wqkv`, `mlp.fc11` / `fc12`,
`emb_ln`), or transformers 5's own NomicBertConfig / NomicBertModel names (`hidden_size`, `layers.N.self_attn.q_proj`,
`mlp.up_proj` / `gate_proj`, ...), read into NomicBertEncoder with the folder's sentence-transformers pooling.

Only the layout llama.cpp's converter also takes is loaded (post-LayerNorm, rotary over the whole head, NeoX halves,
SwiGLU, no biases); anything else (nomic-embed-text-v2-moe's experts, pre-norm, partial or interleaved rotary) is
refused naming the field.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import torch

from edgeserve.errors import ModelLoadError, UnsupportedModelError
from edgeserve.models.encoders.bert import (NOMIC_MODEL_TYPE, EncoderConfig, LoadedEncoder, _json, folder_encoder,
                                   read_encoder_folder, sentence_settings)
from edgeserve.models.encoders.nomic_bert import NomicBertEncoder

# config fields whose other values describe a model NomicBertEncoder does not compute
_REQUIRED = {"prenorm": False, "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False,
             "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False, "moe_every_n_layers": 0,
             "activation_function": "swiglu", "hidden_act": "silu"}
# per-layer tensor names (published checkpoint and transformers 5) -> NomicBertEncoder's
_LAYER = {"attn.out_proj": "attention.output.dense", "self_attn.o_proj": "attention.output.dense",
          "mlp.fc11": "intermediate.dense", "mlp.up_proj": "intermediate.dense",
          "mlp.fc12": "intermediate.gate", "mlp.gate_proj": "intermediate.gate",
          "mlp.fc2": "output.dense", "mlp.down_proj": "output.dense",
          "norm1": "attention.output.LayerNorm", "post_attention_layernorm": "attention.output.LayerNorm",
          "norm2": "output.LayerNorm", "post_mlp_layernorm": "output.LayerNorm", "attn.Wqkv": "attention.qkv"}
_LAYER_NAME = re.compile(r"^(?:encoder\.)?layers\.(\d+)\.(.+)\.(weight|bias)$")


def is_nomic_folder(path: Path) -> bool:
    """Whether a Hugging Face folder's config.json names a nomic-bert model."""
    cfg = _json(path / "config.json") if path.is_dir() else None
    return isinstance(cfg, dict) and cfg.get("model_type") == NOMIC_MODEL_TYPE


def _field(cfg: dict, *names: str, default: Any = None) -> Any:
    """The first of `names` the config has (the published spelling first: transformers' own may be a default)."""
    return next((cfg[n] for n in names if cfg.get(n) is not None), default)


def nomic_config(folder: Path) -> EncoderConfig:
    """The encoder's shape from a nomic-bert config.json, pooling and length from its sentence-transformers files."""
    cfg = _json(folder / "config.json") or {}
    for key, want in _REQUIRED.items():
        if cfg.get(key) is not None and cfg[key] != want:
            raise UnsupportedModelError(f"{folder}: nomic-bert with {key}={cfg[key]!r} is not supported "
                                        f"(only {key}={want!r})")
    rope = cfg.get("rope_parameters") or {}
    max_pos = int(_field(cfg, "max_trained_positions", "max_position_embeddings", default=2048))
    pooling, normalize, max_len = sentence_settings(folder, max_pos)
    try:
        return EncoderConfig(
            vocab_size=int(cfg["vocab_size"]), hidden_size=int(_field(cfg, "n_embd", "hidden_size")),
            num_layers=int(_field(cfg, "n_layer", "num_hidden_layers")),
            num_heads=int(_field(cfg, "n_head", "num_attention_heads")),
            intermediate_size=int(_field(cfg, "n_inner", "intermediate_size")), max_position_embeddings=max_pos,
            type_vocab_size=int(cfg.get("type_vocab_size", 2)),
            layer_norm_eps=float(_field(cfg, "layer_norm_epsilon", "layer_norm_eps", default=1e-12)),
            hidden_act="silu", pooling=pooling, normalize=normalize, max_seq_length=max_len,
            rope_theta=float(_field(cfg, "rotary_emb_base", default=rope.get("rope_theta", 1000.0))))
    except (KeyError, TypeError):
        raise ModelLoadError(f"{folder}/config.json lacks nomic-bert's sizes (n_embd / hidden_size, n_layer, "
                             "n_head, n_inner, vocab_size)") from None


def nomic_weights(raw: dict[str, torch.Tensor], folder: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under NomicBertEncoder's names (separate q / k / v projections stacked into qkv)."""
    out: dict[str, torch.Tensor] = {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in raw.items():
        m = _LAYER_NAME.match(name)
        if m is None:
            out[name.replace("emb_ln.", "embeddings.LayerNorm.")] = t
            continue
        layer, part, kind = m.groups()
        if part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            qkv.setdefault(layer, {})[part[-6]] = t
        elif part in _LAYER:
            out[f"encoder.layer.{layer}.{_LAYER[part]}.{kind}"] = t
    for layer, parts in qkv.items():
        out[f"encoder.layer.{layer}.attention.qkv.weight"] = torch.cat([parts[k] for k in "qkv"])
    if "embeddings.word_embeddings.weight" not in out or "encoder.layer.0.attention.qkv.weight" not in out:
        raise ModelLoadError(f"{folder}: no nomic-bert embeddings / layer-0 attention weights; not a nomic-bert "
                             "checkpoint")
    return out


def load_nomic_folder(source: Any, device: str = "cpu", dtype: str = "auto") -> LoadedEncoder:
    """Load a nomic-bert sentence encoder from a Hugging Face folder (float32 on the CPU, fp16 on accelerators)."""
    start = time.monotonic()
    folder, cfg, dev, weights = read_encoder_folder(source, nomic_config, device, dtype)
    return folder_encoder(source, cfg, NomicBertEncoder(cfg, nomic_weights(weights, folder)), dev, start)
