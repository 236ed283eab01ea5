"""Random LoRA adapters of a model's shapes, written as PEFT folders (adapter_config.json +
adapter_model.safetensors) and as llama.cpp GGUF LoRA files (what convert_lora_to_gguf.py writes), for the tests and
benchmarks/serve/lora_throughput.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_GGUF = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
         "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def _module(p: str) -> str:
    return f"self_attn.{p}" if p in ("q_proj", "k_proj", "v_proj", "o_proj") else f"mlp.{p}"


def shapes(config) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of a ModelConfig."""
    c, f = config, config.intermediate_size
    return {"q_proj": (c.q_size, c.hidden_size), "k_proj": (c.kv_size, c.hidden_size),
            "v_proj": (c.kv_size, c.hidden_size), "o_proj": (c.hidden_size, c.q_size),
            "gate_proj": (f, c.hidden_size), "up_proj": (f, c.hidden_size), "down_proj": (c.hidden_size, f)}


def random_pairs(config, rank: int, seed: int, targets=PROJECTIONS, zero_b: bool = False,
                 std: float = 0.05) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, projection) -> (A [r, in], B [out, r]) float32, normal with `std` (B zero with `zero_b`)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(config.num_layers):
        for p in targets:
            o, k = shapes(config)[p]
            a = torch.randn(rank, k, generator=gen) * std
            b = torch.zeros(o, rank) if zero_b else torch.randn(o, rank, generator=gen) * std
            out[i, p] = (a, b)
    return out


def write_peft(folder: Path, pairs, rank: int, alpha: float, rslora: bool = False) -> Path:
    """A PEFT LoRA folder holding `pairs`."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    targets = sorted({p for _, p in pairs})
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": rslora, "target_modules": targets,
        "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM", "fan_in_fan_out": False,
        "base_model_name_or_path": "tiny"}))
    tensors = {}
    for (i, p), (a, b) in pairs.items():
        key = f"base_model.model.model.layers.{i}.{_module(p)}"
        tensors[key + ".lora_A.weight"] = a.contiguous()
        tensors[key + ".lora_B.weight"] = b.contiguous()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def write_gguf_lora(path: Path, pairs, alpha: float, config, arch: str = "llama") -> Path:
    """A GGUF LoRA file as llama.cpp's convert_lora_to_gguf.py writes it (Q/K B rows permuted for llama)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    for (i, p), (a, b) in pairs.items():
        if arch == "llama" and p in ("q_proj", "k_proj"):
            b = permute(b, config.num_heads if p == "q_proj" else config.num_kv_heads)
        name = f"blk.{i}.{_GGUF[p]}.weight"
        w.add_tensor(name + ".lora_a", a.numpy().astype(np.float32))
        w.add_tensor(name + ".lora_b", b.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's Q/K row permutation (HF rotate-half layout -> interleaved)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
