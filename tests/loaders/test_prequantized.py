"""AWQ (GEMM) and GPTQ 4-bit safetensors checkpoints load as INT4 Q4Blocks.

The checkpoints are written here by a reference packer that follows each format's documented layout in the
plainest way (loops over words and nibbles), from random weights quantized group-wise with integer zeros."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from edgeserve.errors import UnsupportedModelError
from edgeserve.kernels.formats.quant_linear import Int4Weight, Q4Blocks
from edgeserve.loaders.hf_folder import HFFolder
from edgeserve.loaders.prequantized import prequantized_format
from edgeserve.models.attention import ContiguousKV
from edgeserve.models.config import config_from_hf
from edgeserve.models.llama import LlamaModel

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
HIDDEN, FFN, HEADS, KV_HEADS, VOCAB, LAYERS = 64, 128, 4, 2, 96, 2
CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN, "intermediate_size": FFN,
    "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 128, "tie_word_embeddings": True,
}
PROJ = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (HIDDEN // 2, HIDDEN),
        "self_attn.v_proj": (HIDDEN // 2, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
        "mlp.gate_proj": (FFN, HIDDEN), "mlp.up_proj": (FFN, HIDDEN), "mlp.down_proj": (HIDDEN, FFN)}


def quantize_ref(w: torch.Tensor, g: int, min_zero: int = 0):
    """w [out, in] -> q [in, out], integer zeros z [in/g, out] and fp16 scales s [in/g, out]: w ~ (q - z) * s."""
    out_f, in_f = w.shape
    wg = w.t().reshape(in_f // g, g, out_f)
    lo, hi = wg.amin(1), wg.amax(1)
    s = ((hi - lo) / 15).clamp_min(1e-4).half()
    z = torch.round(-lo / s.float()).clamp(min_zero, 15)
    q = (torch.round(wg / s.float().unsqueeze(1)) + z.unsqueeze(1)).clamp(0, 15).reshape(in_f, out_f)
    return q.long(), z.long(), s


def dequant_ref(q, z, s, g) -> torch.Tensor:
    """The [out, in] weight (q - z) * s."""
    return ((q - z.repeat_interleave(g, 0)).float() * s.float().repeat_interleave(g, 0)).t()


def as_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_along_columns(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    """[r, c] values 0..15 -> int32 [r, c/8]; value i of word j holds column 8j + order[i]."""
    r, c = x.shape
    out = torch.zeros(r, c // 8, dtype=torch.int64)
    for j in range(c // 8):
        for i in range(8):
            out[:, j] |= (x[:, 8 * j + order[i]] & 0xF) << (4 * i)
    return as_int32(out)


def pack_along_rows(x: torch.Tensor) -> torch.Tensor:
    """[r, c] values 0..15 -> int32 [r/8, c]; value i of word (j, col) holds row 8j + i."""
    r, c = x.shape
    out = torch.zeros(r // 8, c, dtype=torch.int64)
    for j in range(r // 8):
        for i in range(8):
            out[j] |= (x[8 * j + i] & 0xF) << (4 * i)
    return as_int32(out)


def write_checkpoint(folder: Path, method: str, g: int = 32, fmt: str = "gptq", act_order: bool = False):
    """A tiny llama checkpoint quantized with `method`; returns the float [out, in] weights it stands for."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5).half(),
               "model.norm.weight": torch.ones(HIDDEN).half()}
    expected = {}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        tensors[p + "input_layernorm.weight"] = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).half()
        tensors[p + "post_attention_layernorm.weight"] = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).half()
        for proj, shape in PROJ.items():
            w = torch.randn(*shape, generator=gen) * 0.3
            # GPTQ v1 stores zero - 1 in 4 bits, so a zero of 0 cannot be written faithfully: use 1..15
            gs = g if g > 0 else shape[1]  # -1: one group per row
            q, z, s = quantize_ref(w, gs, min_zero=1 if method == "gptq" and fmt == "gptq" else 0)
            name = p + proj
            expected[name + ".weight"] = dequant_ref(q, z, s, gs)
            tensors[name + ".scales"] = s
            if method == "awq":
                tensors[name + ".qweight"] = pack_along_columns(q, AWQ_ORDER)
                tensors[name + ".qzeros"] = pack_along_columns(z, AWQ_ORDER)
            else:
                tensors[name + ".qweight"] = pack_along_rows(q)
                tensors[name + ".qzeros"] = pack_along_columns(z - 1 if fmt == "gptq" else z, list(range(8)))
                g_idx = torch.arange(shape[1], dtype=torch.int32) // gs
                if act_order:
                    g_idx = g_idx[torch.randperm(shape[1], generator=gen)]
                tensors[name + ".g_idx"] = g_idx
    save_file(tensors, str(folder / "model.safetensors"))
    qc = ({"quant_method": "awq", "bits": 4, "group_size": g, "version": "gemm", "zero_point": True}
          if method == "awq" else
          {"quant_method": "gptq", "bits": 4, "group_size": g, "desc_act": act_order, "sym": False,
           "checkpoint_format": fmt})
    (folder / "config.json").write_text(json.dumps({**CONFIG, "quantization_config": qc}))
    return expected


def logits(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    c = model.config
    kv = ContiguousKV(c.num_layers, len(ids), c.num_kv_heads, c.head_dim, model.dtype)
    return model.logits(model.forward(ids, torch.arange(len(ids)), kv))


@pytest.mark.parametrize("method,fmt", [("awq", None), ("gptq", "gptq"), ("gptq", "gptq_v2")])
def test_prequantized_checkpoint_loads_as_int4(tmp_path, method, fmt):
    expected = write_checkpoint(tmp_path, method, fmt=fmt or "gptq")
    folder = HFFolder(tmp_path)
    weights = folder.weights()
    assert weights.stored_quantized() == [method]
    for name, w in expected.items():
        assert weights.has(name)
        blocks = weights.get(name, keep_int4=True)
        assert isinstance(blocks, Q4Blocks) and blocks.group_size == 32 and blocks.shape == w.shape
        torch.testing.assert_close(blocks.dequantize(), w, rtol=0, atol=1e-6)
        torch.testing.assert_close(weights.get(name, keep_int4=False), w, rtol=0, atol=1e-6)
    config = config_from_hf(folder.config)
    fast = LlamaModel.from_weights(config, weights, dtype=torch.bfloat16)
    assert all(isinstance(w, Int4Weight) for layer in fast.layers for w in (layer.qkv, layer.o_proj, layer.down))
    exact = LlamaModel.from_weights(config, weights, dtype=torch.float32)
    torch.testing.assert_close(exact.layers[1].down, expected["model.layers.1.mlp.down_proj.weight"],
                               rtol=0, atol=1e-6)
    ids = torch.arange(1, 30)
    ref, out = logits(exact, ids), logits(fast, ids)
    assert (ref - out).abs().mean() < 0.1 * ref.abs().mean()  # bf16 compute over the same 4-bit values


def test_gptq_act_order_is_refused(tmp_path):
    write_checkpoint(tmp_path, "gptq", act_order=True)
    weights = HFFolder(tmp_path).weights()
    with pytest.raises(UnsupportedModelError, match="act-order"):
        weights.get("model.layers.0.self_attn.q_proj.weight", keep_int4=True)


@pytest.mark.parametrize("qc,message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes' is not supported"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "AWQ with 8 bits"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ with 3 bits"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "format 'marlin'"),
])
def test_other_quantizations_are_refused_by_name(qc, message):
    with pytest.raises(UnsupportedModelError, match=message):
        prequantized_format({"quantization_config": qc})


def test_plain_checkpoint_has_no_format():
    assert prequantized_format(dict(CONFIG)) is None


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_per_channel_checkpoint_runs_on_cpu_int4_and_triton_w4a16(tmp_path, method):
    """group_size -1 (one group per row): regrouped exactly for the CPU op; the W4A16 kernel takes it as is."""
    from kernel_utils import kernel_device

    from edgeserve.kernels import dispatch

    expected = write_checkpoint(tmp_path, method, g=-1)
    weights = HFFolder(tmp_path).weights()
    name = "model.layers.0.mlp.down_proj.weight"
    blocks = weights.get(name, keep_int4=True)
    assert blocks.group_size == FFN
    x = torch.randn(3, FFN)
    ref = x @ expected[name].t()
    cpu = Int4Weight(blocks, torch.bfloat16).matmul(x.bfloat16()).float()
    assert (cpu - ref).abs().max() < 0.02 * ref.abs().max()
    kernel_device("cpu")  # the rest runs Triton on CPU tensors: only in its interpreter (skips in a GPU process)
    with dispatch.force_backend("triton"):
        y = dispatch.linear(x, dispatch.repack_q4(blocks, torch.float32))
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
