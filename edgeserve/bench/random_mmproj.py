"""Write a Qwen2.5-VL / Qwen3-VL vision tower as a llama.cpp mmproj GGUF, as llama.cpp's converter
(convert_hf_to_gguf.py, conversion/qwenvl.py and qwen3vl.py) does: the Conv3d patch embedding split into two Conv2d
halves, Qwen2.5-VL's fused qkv split into q / k / v, DeepStack mergers under their ViT layer's index, `clip.*`
metadata. Tests write their tiny towers with it; benchmarks/make_mmproj.py writes random ones of real shapes."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from edgeserve.vision.qwen_vl import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, gguf_name


def write_qwen_mmproj(path: str | Path, vision_config: Mapping[str, Any], state: Mapping[str, torch.Tensor],
                      qwen3: bool, matrix_type: str = "F32", image_mean: tuple[float, ...] | None = None,
                      image_std: tuple[float, ...] | None = None) -> Path:
    """Write the tower `state` (HF names with or without `visual.` / `model.visual.`) of an HF `vision_config` as an
    mmproj GGUF at `path`; `matrix_type` ("F32", "F16" or "Q8_0") is the type of its 2-D+ weights (norms, biases
    and the position table stay F32, as the converter keeps them; a Q8_0 file keeps F16 where a row is not whole
    32-value blocks, and for the patch embedding, as llama.cpp's quantizer does)."""
    import gguf

    v = vision_config
    deepstack = tuple(v.get("deepstack_visual_indexes") or ()) if qwen3 else ()
    depth = int(v["depth"])
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type("qwen3vl_merger" if qwen3 else "qwen2.5vl_merger")
    patch = int(v.get("patch_size", 16 if qwen3 else 14))
    w.add_vision_patch_size(patch)
    side = int(int(v.get("num_position_embeddings", 0)) ** 0.5) if qwen3 else 40
    w.add_vision_image_size(side * patch)
    w.add_vision_embedding_length(int(v["hidden_size"]))
    w.add_vision_feed_forward_length(int(v["intermediate_size"]))
    w.add_vision_block_count(depth)
    w.add_vision_head_count(int(v["num_heads"]))
    w.add_vision_projection_dim(int(v["out_hidden_size"]))
    w.add_vision_attention_layernorm_eps(1e-6)
    w.add_vision_spatial_merge_size(int(v.get("spatial_merge_size", 2)))
    mean = image_mean or ((0.5,) * 3 if qwen3 else OPENAI_CLIP_MEAN)
    std = image_std or ((0.5,) * 3 if qwen3 else OPENAI_CLIP_STD)
    w.add_vision_image_mean(list(mean))
    w.add_vision_image_std(list(std))
    if qwen3:
        w.add_vision_use_gelu(True)
        w.add_vision_is_deepstack_layers([i in deepstack for i in range(depth)])
    else:
        w.add_vision_use_silu(True)
        full = list(v.get("fullatt_block_indexes") or ())
        w.add_vision_n_wa_pattern(full[0] + 1 if full else 0)
        if int(v.get("window_size", 112)) != 112:  # llama.cpp assumes 112 where the key is absent
            w.add_vision_window_size(int(v["window_size"]))
    for name, t in _tensors(state, qwen3, deepstack):
        if t.dim() < 2 or "position_embd" in name or matrix_type == "F32":
            w.add_tensor(name, t.float().numpy())
        elif matrix_type == "Q8_0" and t.dim() == 2 and t.shape[1] % 32 == 0:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(t.float().numpy(), q8), raw_dtype=q8)
        else:
            w.add_tensor(name, t.to(torch.float16).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _tensors(state: Mapping[str, torch.Tensor], qwen3: bool, deepstack: tuple[int, ...]):
    """(mmproj name, tensor) of each tower tensor, as llama.cpp's converter names and splits them."""
    for full, t in state.items():
        if full.startswith(("model.visual.", "visual.")):
            name = full.split("visual.", 1)[1]
        elif full.startswith(("model.", "lm_head.")):
            continue  # the language model's
        else:
            name = full
        if name == "patch_embed.proj.weight":
            yield "v.patch_embd.weight", t[:, :, 0]
            yield "v.patch_embd.weight.1", t[:, :, 1]
        elif not qwen3 and ".attn.qkv." in name:
            for part, chunk in zip("qkv", t.chunk(3, dim=0)):
                yield gguf_name(name.replace("attn.qkv", f"attn.{part}"), deepstack), chunk
        else:
            yield gguf_name(name, deepstack), t
