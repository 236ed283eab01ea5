"""Write vision towers as llama.cpp mmproj GGUFs: random SigLIP ones of Gemma 3's and SmolVLM's real shapes
(write_siglip_mmproj), and a Qwen2.5-VL / Qwen3-VL tower as llama.cpp's converter
(convert_hf_to_gguf.py, conversion/qwenvl.py and qwen3vl.py) does: the Conv3d patch embedding split into two Conv2d
halves, Qwen2.5-VL's fused qkv split into q / k / v, DeepStack mergers under their ViT layer's index, `clip.*`
metadata. Tests write their tiny towers with it; benchmarks/make_mmproj.py writes random ones of real shapes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
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


# the towers and projectors of the real models (their config.json / preprocessor_config.json)
SIGLIP_SHAPES = {
    # Gemma 3 4B: SigLIP so400m at 896, average-pooled to 256 tokens, into a 2560-wide LM
    "gemma3-4b": dict(kind="gemma3", hidden=1152, ffn=4304, layers=27, heads=16, patch=14, image=896, lm=2560),
    # SmolVLM-256M-Instruct: SigLIP base at 512 tiles, pixel shuffle 4, into a 576-wide LM, images to 2048 first
    "smolvlm-256m": dict(kind="idefics3", hidden=768, ffn=3072, layers=12, heads=12, patch=16, image=512, lm=576,
                         scale=4, longest=2048),
}


def _add_siglip_keys(w, s: SimpleNamespace) -> None:
    """The `clip.*` keys of a Gemma 3 / SmolVLM mmproj of shape `s`, as llama.cpp's converter writes them."""
    w.add_string("clip.projector_type", s.kind)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_gelu", True)
    for key, value in (("embedding_length", s.hidden), ("feed_forward_length", s.ffn), ("block_count", s.layers),
                       ("attention.head_count", s.heads), ("image_size", s.image), ("patch_size", s.patch)):
        w.add_uint32(f"clip.vision.{key}", value)
    w.add_uint32("clip.vision.projection_dim", s.lm)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    if s.kind == "idefics3":
        w.add_uint32("clip.vision.projector.scale_factor", s.scale)
        w.add_uint32("clip.vision.preproc_image_size", s.longest)


def write_siglip_mmproj(path: Path, shape: dict, qtype: str, seed: int = 0) -> Path:
    """A random-weight Gemma 3 / SmolVLM mmproj GGUF of `shape` (SIGLIP_SHAPES) as llama.cpp's converter names it; the
    layer matrices stored as `qtype` (F16, or Q8_0 where a row is whole 32-value blocks)."""
    import gguf

    rng = np.random.default_rng(seed)
    s = SimpleNamespace(**shape)
    w = gguf.GGUFWriter(str(path), "clip")
    _add_siglip_keys(w, s)

    def mat(name: str, rows: int, cols: int, quantize: bool = True) -> None:
        a = (rng.standard_normal((rows, cols), dtype=np.float32) * cols ** -0.5).astype(np.float32)
        if quantize and qtype == "Q8_0" and cols % 32 == 0:  # else F16, as llama.cpp's quantizer keeps it
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, a.astype(np.float16))

    def vec(name: str, n: int, value: float | None = None) -> None:
        w.add_tensor(name, np.full(n, value, np.float32) if value is not None
                     else (rng.standard_normal(n, dtype=np.float32) * 0.02))

    n_pos = (s.image // s.patch) ** 2
    w.add_tensor("v.patch_embd.weight", (rng.standard_normal((s.hidden, 3, s.patch, s.patch), dtype=np.float32)
                                         * 0.02))
    vec("v.patch_embd.bias", s.hidden)
    w.add_tensor("v.position_embd.weight", rng.standard_normal((n_pos, s.hidden), dtype=np.float32) * 0.02)
    for i in range(s.layers):
        for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
            mat(f"v.blk.{i}.{part}.weight", s.hidden, s.hidden)
            vec(f"v.blk.{i}.{part}.bias", s.hidden)
        mat(f"v.blk.{i}.ffn_up.weight", s.ffn, s.hidden)
        vec(f"v.blk.{i}.ffn_up.bias", s.ffn)
        mat(f"v.blk.{i}.ffn_down.weight", s.hidden, s.ffn)
        vec(f"v.blk.{i}.ffn_down.bias", s.hidden)
        for ln in ("ln1", "ln2"):
            vec(f"v.blk.{i}.{ln}.weight", s.hidden, 1.0)
            vec(f"v.blk.{i}.{ln}.bias", s.hidden, 0.0)
    vec("v.post_ln.weight", s.hidden, 1.0)
    vec("v.post_ln.bias", s.hidden, 0.0)
    if s.kind == "gemma3":
        w.add_tensor("mm.input_projection.weight", (rng.standard_normal((s.hidden, s.lm), dtype=np.float32)
                                                    * s.hidden ** -0.5).astype(np.float16))
        vec("mm.soft_emb_norm.weight", s.hidden, 1.0)
    else:
        mat("mm.model.fc.weight", s.lm, s.hidden * s.scale ** 2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
