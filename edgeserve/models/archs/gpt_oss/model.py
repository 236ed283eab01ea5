"""gpt-oss: the Llama-family decoder with biases on Q/K/V/O, attention sinks, a sliding window (128) on every
other layer, YaRN RoPE, and a Mixture-of-Experts feed-forward (top-k of the router's logits, softmax over those;
expert biases; the clamped SwiGLU kernels.torch.activation.swiglu_oai).

HF checkpoints keep each layer's experts fused and transposed, `mlp.experts.gate_up_proj` [E, hidden, 2F] with gate
and up columns interleaved (and `gate_up_proj_bias` [E, 2F] likewise), `down_proj` [E, F, hidden]; GptOssWeights
serves them as the MoE loader's [E, 2F, hidden] (gate rows first) and [E, hidden, F]. OpenAI's own checkpoints
store those experts in MXFP4 instead (`*_blocks` [E, rows, cols / 32, 16], `*_scales` [E, rows, cols / 32], rows
being the output features): they are re-laid out as GGUF MXFP4 block bytes (the same codes and exponents, nibbles
in GGUF's order), which the native CPU kernels run as they are and the other paths dequantize. llama.cpp's GGUF
stores the
experts split already (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`, with biases), the router as
`ffn_gate_inp` (+ bias), the sinks as `attn_sinks`, and the pre-MLP norm as `post_attention_norm`.
"""

from __future__ import annotations

import functools
import re

import torch

from edgeserve.errors import ModelLoadError
from edgeserve.kernels.dispatch import add_rms_norm, linear, rms_norm, rope_write_kv, swiglu_oai
from edgeserve.kernels.formats.experts import ExpertBlocks
from edgeserve.kernels.formats.quant_linear import PromptRows
from edgeserve.kernels.torch.rope import apply_rope
from edgeserve.loaders.dequant import dequantize
from edgeserve.loaders.weights import WeightSource, WeightValue

from edgeserve.models.attention import KVAttention
from edgeserve.models.config import ModelConfig
from edgeserve.models.llama import LlamaModel
from edgeserve.models.moe import MoEConfig, ffn_input_dtype
from edgeserve.models.moe_weights import load_moe_layer

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def mxfp4_to_gguf(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """HF MXFP4 experts (`blocks` uint8 [..., groups, 16], value 2k in byte k's low nibble and 2k + 1 in its high
    one; `scales` uint8 [..., groups], E8M0) as GGUF MXFP4 bytes [..., groups * 17]: per block the exponent byte,
    then 16 bytes holding values j (low nibble) and j + 16 (high nibble)."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., groups, 32] in value order
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([scales.unsqueeze(-1), qs], dim=-1).flatten(-2).contiguous()


class GptOssWeights:
    """A WeightSource serving gpt-oss's tensors under the names the Llama and MoE loaders ask for: the router as
    `mlp.gate`, HF's fused expert tensors de-interleaved and transposed, GGUF's `post_attention_norm` as the pre-MLP
    norm."""

    def __init__(self, source: WeightSource):
        self.source = source
        self.gguf = getattr(source, "gguf", None)
        self.hf = source.has("model.layers.0.mlp.router.weight")
        if not self.hf and self.gguf is None:
            raise ModelLoadError("gpt-oss weights need HF names (mlp.router, mlp.experts.gate_up_proj) or a GGUF file")

    def _local(self, name: str) -> tuple[str, str] | None:
        m = _LAYER.fullmatch(name)
        return (m.group(1), m.group(2)) if m else None

    def has(self, name: str) -> bool:
        found = self._local(name)
        if found and self.hf:
            i, local = found
            if local in ("mlp.gate.weight", "mlp.gate.bias"):
                return self.source.has(f"model.layers.{i}.mlp.router.{local.rpartition('.')[2]}")
            if local in _EXPERTS:
                return self.source.has(name) or self.source.has(name + "_blocks")
        if found and not self.hf and found[1] == "post_attention_layernorm.weight":
            return True
        return self.source.has(name)

    def get(self, name: str, keep_int4: bool) -> WeightValue:
        found = self._local(name)
        if found is None:
            return self.source.get(name, keep_int4)
        i, local = found
        p = f"model.layers.{i}."
        if not self.hf:
            if local == "post_attention_layernorm.weight":
                assert self.gguf is not None
                return self.gguf.load_tensor(f"blk.{i}.post_attention_norm.weight", torch.float32)
            return self.source.get(name, keep_int4)
        if local in ("mlp.gate.weight", "mlp.gate.bias"):
            return self.source.get(p + "mlp.router." + local.rpartition(".")[2], keep_int4)
        if local in _EXPERTS and not self.source.has(name):  # MXFP4: the re-laid-out blocks, dequantized
            found_blocks = self._mxfp4(name)
            return dequantize(found_blocks.data.numpy(), "MXFP4", found_blocks.shape)
        if local == "mlp.experts.gate_up_proj":  # [E, hidden, 2F] interleaved -> [E, 2F, hidden], gate rows first
            w = self._dense(name)
            return torch.cat([w[..., 0::2], w[..., 1::2]], dim=-1).transpose(1, 2).contiguous()
        if local == "mlp.experts.gate_up_proj_bias":  # [E, 2F] interleaved -> [gate | up]
            b = self._dense(name)
            return torch.cat([b[:, 0::2], b[:, 1::2]], dim=-1)
        if local == "mlp.experts.down_proj":  # [E, F, hidden] -> [E, hidden, F]
            return self._dense(name).transpose(1, 2).contiguous()
        return self.source.get(name, keep_int4)

    def _dense(self, name: str) -> torch.Tensor:
        value = self.source.get(name, keep_int4=False)
        assert isinstance(value, torch.Tensor)
        return value.float()

    def stored_quantized(self) -> list[str]:
        return self.source.stored_quantized()  # type: ignore[attr-defined]

    @property
    def expert_bytes(self) -> int | None:
        """The wrapped source's expert bytes (a GGUF's 3-D tensors), which the MoE loader's rule for copying
        experts into the kernels' faster layout reads (moe_weights.want_repacked_experts); None where it has none."""
        return getattr(self.source, "expert_bytes", None)

    def blocks(self, name: str):
        """A 2-D tensor's GGUF block bytes for the native CPU kernels (None where the source has none)."""
        blocks = getattr(self.source, "blocks", None)
        return None if blocks is None else blocks(name)

    def expert_blocks(self, name: str) -> ExpertBlocks | None:
        """A 3-D expert tensor's GGUF block bytes: the GGUF's own, or an HF checkpoint's MXFP4 experts re-laid out
        (None for HF float experts)."""
        if self.hf:
            return self._mxfp4(name) if self.source.has(name + "_blocks") else None
        found = getattr(self.source, "expert_blocks", None)
        return None if found is None else found(name)

    def _mxfp4(self, name: str) -> ExpertBlocks:
        """HF MXFP4 experts `name` as GGUF MXFP4 blocks [E, rows, bytes] in the loader's layout (gate_up: the gate
        rows, then the up rows)."""
        blocks = self.source.get(name + "_blocks", keep_int4=False)
        scales = self.source.get(name + "_scales", keep_int4=False)
        assert isinstance(blocks, torch.Tensor) and isinstance(scales, torch.Tensor)
        data = mxfp4_to_gguf(blocks.to(torch.uint8), scales.to(torch.uint8))  # [E, rows, groups * 17]
        if name.endswith("gate_up_proj"):  # interleaved gate / up rows -> gate rows first
            data = torch.cat([data[:, 0::2], data[:, 1::2]], dim=1).contiguous()
        return ExpertBlocks("MXFP4", data, blocks.shape[-2] * 32)


class GptOssModel(LlamaModel):
    """gpt-oss over flat token batches (same interface as LlamaModel). On the CPU with block-format weights its
    steps run in the fused native stack (kernels.cpu.decoder: sinks, o_proj biases, sliding layers and the MoE
    layer of kernels/cpu/src/moe_layer.c); elsewhere, the per-op path below, which calls the same kernels."""

    o_biases: list[torch.Tensor]
    sinks: list[torch.Tensor]

    @classmethod
    def from_weights(cls, config: ModelConfig, source: WeightSource, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu", keep_int4: bool = True,
                     dense_prefill: bool = False) -> "GptOssModel":
        """Build the model from HF gpt_oss or GGUF gpt-oss weights."""
        weights = GptOssWeights(source)
        model = super().from_weights(config, weights, dtype, device, keep_int4, dense_prefill)
        assert isinstance(model, GptOssModel)
        dev = torch.device(device)

        def vector(name: str) -> torch.Tensor:
            value = weights.get(name, keep_int4=False)
            assert isinstance(value, torch.Tensor)
            return value.to(device=dev, dtype=torch.float32)

        model.o_biases = [vector(f"model.layers.{i}.self_attn.o_proj.bias") for i in range(config.num_layers)]
        model.sinks = [vector(f"model.layers.{i}.self_attn.sinks") for i in range(config.num_layers)]
        return model

    @classmethod
    def feed_forward(cls, config: ModelConfig, source: WeightSource, i: int, matrix, device: torch.device,
                     dtype: torch.dtype) -> dict:
        """Layer i's MoE layer: top-k of the logits then a softmax over them, clamped SwiGLU experts with biases."""
        act = functools.partial(swiglu_oai, alpha=config.swiglu_alpha, limit=config.swiglu_limit)
        moe = MoEConfig(config.num_experts, config.experts_per_token, config.moe_intermediate_size, "topk_softmax",
                        False, act)
        return dict(gate_up=None, down=None, moe=load_moe_layer(config, source, i, matrix, device, dtype, moe))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: KVAttention,
                prompt_rows: PromptRows | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] for a flat batch of T tokens at the given positions (see LlamaModel)."""
        c = self.config
        eps = c.rms_norm_eps
        x = self.embed_rows(input_ids)
        fused = self.fused_forward(x, positions, attn)  # the whole stack in one native call, where it runs
        if fused is not None:
            return fused
        if x.shape[0] and int(positions.max()) >= self.max_positions:
            raise IndexError(f"position {int(positions.max())} is past the model's {self.max_positions}")
        cos, sin = self.cos[positions], self.sin[positions]
        paged = hasattr(attn, "layer_cache") and hasattr(attn, "attend")
        windows = c.layer_windows or (None,) * len(self.layers)
        h = rms_norm(x, self.layers[0].input_norm, eps).to(self.dtype)
        for i, layer in enumerate(self.layers):
            q, k, v = self.project_qkv(layer, h, prompt_rows)
            if paged:
                k_cache, v_cache, slots = attn.layer_cache(i)  # type: ignore[attr-defined]
                q = rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
                o = attn.attend(i, q, window=windows[i], sinks=self.sinks[i])  # type: ignore[attr-defined]
            else:
                q, k = apply_rope(q, cos, sin).to(self.dtype), apply_rope(k, cos, sin).to(self.dtype)
                o = attn(i, q, k, v.to(self.dtype), window=windows[i], sinks=self.sinks[i])  # type: ignore[call-arg]
            h, x = add_rms_norm(linear(o, layer.o_proj, self.o_biases[i].to(o.dtype), prompt_rows), x,
                                layer.post_norm, eps, ffn_input_dtype(layer, self.dtype))
            y = self.mlp(layer, h, prompt_rows)
            last = i + 1 == len(self.layers)
            h, x = add_rms_norm(y, x, self.norm if last else self.layers[i + 1].input_norm, eps, self.dtype)
        return h


def model_class(config: ModelConfig) -> type[GptOssModel]:
    """gpt-oss's decoder (edgeserve.models.registry's hook)."""
    return GptOssModel


def dummy_layer_shapes(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """The shapes of a layer's tensors beyond q/k/v/o and the norms, under HF gpt_oss's names and layouts, for
    random weights (edgeserve.models.dummy): router, fused experts with biases, o_proj's bias, the sinks."""
    c, p = config, prefix
    e, f, h = c.num_experts, c.moe_intermediate_size, c.hidden_size
    return {p + "mlp.router.weight": (e, h), p + "mlp.router.bias": (e,), p + "mlp.experts.gate_up_proj": (e, h, 2 * f),
            p + "mlp.experts.gate_up_proj_bias": (e, 2 * f), p + "mlp.experts.down_proj": (e, f, h),
            p + "mlp.experts.down_proj_bias": (e, h), p + "self_attn.o_proj.bias": (h,),
            p + "self_attn.sinks": (c.num_heads,)}
