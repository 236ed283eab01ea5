"""GGUF tensors exposed under Hugging Face Llama names, read one tensor at a time from the mmap."""

from __future__ import annotations

import functools
import re

import numpy as np
import torch

from edgeserve.errors import ModelLoadError
from edgeserve.kernels.cpu.native import BlockTensor, native_format
from edgeserve.kernels.formats.experts import ExpertBlocks
from edgeserve.kernels.formats.quant_linear import Q4Blocks, Q8Blocks

from .dequant import q4_blocks, q8_blocks
from .gguf_file import GGUFFile, check_supported_qtype, release_pages
from .weights import WeightValue, unpermute_qk

_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "rope_freqs": "rope_freqs.weight",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.sinks": "attn_sinks.weight",  # gpt-oss: per-head attention sinks
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # fused (Phi-3): edgeserve.models.archs.phi3 splits them
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    # Mixture-of-Experts (edgeserve.models.moe_weights): the router, every expert's projection as one 3-D tensor
    # [experts, rows, cols] (HF's fused names where HF has them), their biases [experts, rows], a shared expert
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.bias": "ffn_gate_inp.bias",
    "mlp.experts.gate_proj": "ffn_gate_exps.weight",
    "mlp.experts.up_proj": "ffn_up_exps.weight",
    "mlp.experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.experts.gate_proj_bias": "ffn_gate_exps.bias",
    "mlp.experts.up_proj_bias": "ffn_up_exps.bias",
    "mlp.experts.gate_up_proj_bias": "ffn_gate_up_exps.bias",
    "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
Q4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


@functools.lru_cache(maxsize=None)
def _names(arch: str) -> tuple[dict[str, str], dict[str, str]]:
    """(top-level, per-layer) HF-to-llama.cpp tensor names of `arch`: Llama's, with its package's own over them
    (GGUF_TOP / GGUF_LAYER, edgeserve.models.registry)."""
    from edgeserve.models.registry import find_gguf_architecture

    spec = find_gguf_architecture(arch)
    if spec is None:
        return _TOP, _LAYER
    return {**_TOP, **spec.declared("GGUF_TOP", {})}, {**_LAYER, **spec.declared("GGUF_LAYER", {})}


def permuted_qk(arch: str) -> bool:
    """Whether llama.cpp's converter permuted `arch`'s Q/K rows for its interleaved RoPE (PERMUTED_QK)."""
    from edgeserve.models.registry import find_gguf_architecture

    spec = find_gguf_architecture(arch)
    return spec is not None and bool(spec.declared("PERMUTED_QK", False))


def gguf_name(hf_name: str, arch: str = "") -> str:
    """The llama.cpp tensor name for an HF tensor name (`arch`: the file's architecture, for its own names)."""
    top, layer = _names(arch)
    if hf_name in top:
        return top[hf_name]
    m = _LAYER_RE.fullmatch(hf_name)
    if m and m.group(2) in layer:
        return f"blk.{m.group(1)}.{layer[m.group(2)]}"
    raise KeyError(hf_name)


class GGUFWeights:
    """WeightSource over a GGUFFile."""

    def __init__(self, gguf: GGUFFile, n_heads: int, n_kv_heads: int):
        self.gguf = gguf
        self._names = set(gguf.tensor_names())
        # llama.cpp permutes Q/K rows for its interleaved RoPE only for the llama family.
        self._permuted = permuted_qk(gguf.architecture)
        self._heads = {"q_proj": n_heads, "k_proj": n_kv_heads}
        for name in self._names:
            check_supported_qtype(gguf.tensor_info(name).qtype, name)

    def has(self, name: str) -> bool:
        try:
            return gguf_name(name, self.gguf.architecture) in self._names
        except KeyError:
            return False

    def get(self, name: str, keep_int4: bool) -> WeightValue:
        gname = gguf_name(name, self.gguf.architecture)
        if gname not in self._names:
            raise ModelLoadError(f"{self.gguf.path}: tensor {gname!r} is missing")
        info = self.gguf.tensor_info(gname)
        value: WeightValue
        if keep_int4 and info.qtype in Q4_TYPES and len(info.shape) == 2:
            q, scale, offset = q4_blocks(self.gguf.raw(gname), info.qtype, info.shape)
            value = Q4Blocks(q, scale, offset, 32)
        elif keep_int4 and info.qtype == "Q8_0" and len(info.shape) == 2:
            value = Q8Blocks(*q8_blocks(self.gguf.raw(gname), info.shape), 32)
        else:
            value = self.gguf.load_tensor(gname, torch.float32)
        return self._unpermuted(name, value)

    def _unpermuted(self, name: str, value: WeightValue) -> WeightValue:
        if self._permuted:
            for proj, heads in self._heads.items():
                if f"self_attn.{proj}." in name:
                    value = unpermute_qk(value, heads)
        return value

    def blocks(self, name: str) -> BlockTensor | None:
        """A 2-D tensor as its GGUF block bytes (for the native CPU kernels), or None when it is not stored in
        a block format those kernels take."""
        gname = gguf_name(name, self.gguf.architecture)
        if gname not in self._names:
            raise ModelLoadError(f"{self.gguf.path}: tensor {gname!r} is missing")
        if len(self.gguf.tensor_info(gname).shape) != 2:
            return None
        found = gguf_blocks(self.gguf, gname)
        if found is None:
            return None
        value = self._unpermuted(name, found)
        assert isinstance(value, BlockTensor)
        return value

    @functools.cached_property
    def expert_bytes(self) -> int:
        """Bytes of the file's 3-D (expert) tensors."""
        return sum(self.gguf.tensor_info(n).n_bytes for n in self._names if len(self.gguf.tensor_info(n).shape) == 3)

    def expert_blocks(self, name: str) -> ExpertBlocks | None:
        """A 3-D expert tensor [experts, rows, cols] as its GGUF block bytes, a view of the file's mmap (no copy),
        or None when it is not stored in a block format the native kernels take."""
        gname = gguf_name(name, self.gguf.architecture)
        if gname not in self._names:
            raise ModelLoadError(f"{self.gguf.path}: tensor {gname!r} is missing")
        info = self.gguf.tensor_info(gname)
        if len(info.shape) != 3 or not native_format(info.qtype, info.shape[2]):
            return None
        return ExpertBlocks(info.qtype, self.gguf.raw(gname), info.shape[2])

    def stored_quantized(self) -> list[str]:
        """The quantization types (not F32/F16/BF16) of the model's weight matrices (2-D, and 3-D expert stacks),
        e.g. ["Q4_K", "Q6_K"] or ["MXFP4", "Q8_0"]."""
        types = {self.gguf.tensor_info(n).qtype for n in self._names if len(self.gguf.tensor_info(n).shape) >= 2}
        return sorted(types - {"F32", "F16", "BF16"})


def gguf_blocks(gguf: GGUFFile, gname: str, index: int | None = None) -> BlockTensor | None:
    """The tensor `gname` (a GGUF name) as its block bytes for the native CPU kernels: a 2-D tensor [rows, cols],
    or with `index` matrix `index` of a 3-D one (GGUF shape [E, rows, cols]: expert `index` of a MoE layer's
    stack); None when it is not stored in a block format those kernels take. Reads (copies) only that matrix."""
    info = gguf.tensor_info(gname)
    if len(info.shape) != (2 if index is None else 3):
        raise ModelLoadError(f"{gguf.path}: tensor {gname!r} has shape {info.shape}, not "
                             f"{'[rows, cols]' if index is None else '[experts, rows, cols]'}")
    if index is not None and not 0 <= index < info.shape[0]:
        raise ModelLoadError(f"{gguf.path}: tensor {gname!r} has {info.shape[0]} experts, not {index + 1}")
    if not native_format(info.qtype, info.shape[-1]):
        return None
    raw = gguf.raw(gname)
    data = torch.from_numpy(np.array(raw if index is None else raw[index]))  # a copy: the mmap is read-only
    if index is None:  # the copy is what the model keeps: the file's pages need not stay mapped beside it
        release_pages(raw)
    return BlockTensor(info.qtype, data, info.shape[-1])
