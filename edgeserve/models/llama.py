"""The Llama-family decoder (llama, mistral, qwen2, qwen3) over flat token batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from edgeserve.kernels.cpu.decoder import NativeDecoder
from edgeserve.kernels.cpu.native import BlockWeight, block_weight
from edgeserve.kernels.dispatch import (
    add_rms_norm,
    linear,
    repack_q4,
    repack_q8,
    rms_norm,
    rope_write_kv,
    silu_and_mul,
    softcap,
    use_triton,
)
from edgeserve.kernels.formats.quant_linear import (
    Int4Weight,
    Int8Weight,
    LinearWeight,
    PromptRows,
    Q4Blocks,
    Q8Blocks,
    int4_supported,
    int8_supported,
)
from edgeserve.kernels.torch.rope import apply_rope, rope_attention_factor, rope_cos_sin, rope_inv_freq
from edgeserve.loaders.weights import WeightSource, WeightValue

from .attention import KVAttention
from .config import ModelConfig
from .lora_step import StepLora
from .moe import MoELayer, ffn_input_dtype
from .mrope import mrope_axes, mrope_cos_sin
from .text_part import text_part


@dataclass
class DecoderLayer:
    """One transformer block's weights; Q/K/V and gate/up are fused into one matmul each."""

    input_norm: torch.Tensor
    qkv: LinearWeight
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: LinearWeight
    post_norm: torch.Tensor
    gate_up: LinearWeight | None  # None where `moe` is the feed-forward
    down: LinearWeight | None
    moe: MoELayer | None = None  # a Mixture-of-Experts feed-forward (MoEModel)


def merge_image_rows(x: torch.Tensor, image_rows: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The embedded batch x [T, hidden] with rows `image_rows[0]` replaced by `image_rows[1]` (an image's embedding
    rows stand where its placeholder tokens are, after any embedding scale: they are the LM's inputs as they are)."""
    if image_rows is None:
        return x
    index, rows = image_rows
    x[index] = rows[:, : x.shape[1]].to(x.dtype)  # Qwen3-VL's DeepStack features follow: `deepstack_rows`
    return x


def deepstack_rows(image_rows: tuple[torch.Tensor, torch.Tensor] | None,
                   hidden: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Qwen3-VL's DeepStack features of the step's image rows: (flat indices [n], features [n, k, hidden]) from rows
    [n, hidden * (1 + k)] (the vision tower's output, as llama.cpp lays it out), or None where k is 0."""
    if image_rows is None or image_rows[1].shape[1] == hidden:
        return None
    index, rows = image_rows
    return index, rows[:, hidden:].reshape(rows.shape[0], -1, hidden).float()


def load_matrix(source: WeightSource, names: list[str], dtype: torch.dtype, device: torch.device,
                keep_int4: bool = True, dense_prefill: bool = False) -> LinearWeight:
    """The weight matrices `names` stacked by output rows into one linear weight, in the fastest form the device
    runs: GGUF blocks on the native CPU kernels, 4-bit / 8-bit where supported, else dense `dtype`."""
    native = block_weight(source, names, device, dtype) if not use_triton(device) else None  # GGUF blocks, CPU
    if native is not None:
        return native
    parts: list[WeightValue] = [source.get(n, keep_int4=keep_int4) for n in names]
    if all(isinstance(p, Q4Blocks) for p in parts):
        blocks = Q4Blocks.cat(parts) if len(parts) > 1 else parts[0]  # type: ignore[arg-type]
        if use_triton(device) and blocks.shape[1] % 8 == 0:
            return repack_q4(blocks, dtype, device)  # stays 4-bit on the GPU (Triton W4A16)
        if int4_supported(device, dtype, blocks):
            return Int4Weight(blocks, dtype, keep_dense=dense_prefill)
    if all(isinstance(p, Q8Blocks) for p in parts):
        q8 = Q8Blocks.cat(parts) if len(parts) > 1 else parts[0]  # type: ignore[arg-type]
        if use_triton(device):
            # stays 8-bit on the GPU (Triton W8A16); Q8_0's scales are float16 in the file, kept exact
            return repack_q8(q8, torch.float16, device)
        if int8_supported(device, dtype):
            # GGUF Q8_0 stays 8-bit: requantized per output row for torch's int8 matmul
            return Int8Weight(q8.dequantize(), dtype)
    floats = [p.dequantize() if isinstance(p, (Q4Blocks, Q8Blocks)) else p for p in parts]
    return torch.cat(floats).to(device=device, dtype=dtype)


def set_decoder_fields(model: LlamaModel, config: ModelConfig, embed, layers: list, norm: torch.Tensor,
                       lm_head: LinearWeight, dtype: torch.dtype, device: torch.device) -> None:
    """Set the fields every LlamaModel-interface decoder has (config, embeddings, layers, final norm, head, dtype,
    device) and `max_positions` to the config's."""
    model.config = config
    model.embed = embed
    model.layers = layers
    model.norm = norm
    model.lm_head = lm_head
    model.dtype = dtype
    model.device = device
    model.max_positions = config.max_position_embeddings


def set_rotary_decoder_fields(model: LlamaModel, config: ModelConfig, embed, layers: list, norm: torch.Tensor,
                              lm_head: LinearWeight, inv_freq: torch.Tensor, dtype: torch.dtype,
                              device: torch.device) -> None:
    """set_decoder_fields, the RoPE tables of `inv_freq` over the model's positions (`cos` / `sin`), and the fused
    native stack to plan on the first forward (`_native`)."""
    set_decoder_fields(model, config, embed, layers, norm, lm_head, dtype, device)
    model.cos, model.sin = (t.to(device) for t in rope_cos_sin(inv_freq, model.max_positions))
    model._native = False


class LlamaModel:
    """A Llama-family decoder: token ids + positions + a KV attention -> hidden states -> logits."""

    def __init__(self, config: ModelConfig, embed: torch.Tensor | Int8Weight | BlockWeight, layers: list[DecoderLayer], norm: torch.Tensor,
                 lm_head: LinearWeight, inv_freq: torch.Tensor, dtype: torch.dtype, device: torch.device):
        set_decoder_fields(self, config, embed, layers, norm, lm_head, dtype, device)
        # Within a sliding window full attention is exact, so a windowed model's context stops at the window.
        self.max_positions = min(config.max_position_embeddings, config.sliding_window or config.max_position_embeddings)
        cos, sin = rope_cos_sin(inv_freq, self.max_positions, rope_attention_factor(config.rope_scaling))
        self.cos, self.sin = cos.to(device), sin.to(device)
        # SmolLM3's NoPE layers rotate by these identity tables (cos 1, sin 0), so every layer takes one path
        self.cos_nope, self.sin_nope = (torch.ones_like(self.cos), torch.zeros_like(self.sin)) \
            if config.rope_layers is not None else (None, None)
        self.attend_options = {"scale": config.query_scale} if config.query_scale is not None else {}
        self.mrope_axes = mrope_axes(config.head_dim, config.mrope_sections, config.mrope_interleaved).to(device) \
            if config.mrope_sections else None
        self._native: NativeDecoder | None | bool = False  # the fused native stack, planned on the first forward

    @property
    def act_dtype(self) -> torch.dtype:
        """The dtype of the activations the layers' matmuls read, for an architecture whose layers read it (the
        normed rows of Qwen3.5 and Gemma 4, per op and in their fused stacks; the mixer outputs of LFM2 / LFM3 and
        the Mamba-2 hybrids, `matmul_input`): float32 on the CPU, where every matmul quantizes its input to int8
        blocks or casts it to its weights' dtype itself, so a bf16 copy first only rounds it twice (llama.cpp keeps
        them float32 too; issue 54, docs/MODELS.md); the compute dtype elsewhere. The Llama family's own forward,
        gpt-oss, Gemma 2 / 3 and the Mamba-2 hybrids' normed rows still round to `dtype` (float32 rows for the first
        three measured no closer, branch llamaact; the hybrids' not measured)."""
        return torch.float32 if self.device.type == "cpu" else self.dtype

    def matmul_input(self, x: torch.Tensor) -> torch.Tensor:
        """A float32 row (a mixer's or the attention's output) as a matmul takes it: in `act_dtype` (as it is on
        the CPU, whose matmuls cast or quantize their input themselves)."""
        return x.to(self.act_dtype)

    def native_plan(self) -> NativeDecoder | None:
        """This architecture's plan of the whole layer stack as one native call, or None where it does not apply:
        kernels.cpu.decoder's for the Llama-like models (None for weights not in native block formats, attention
        soft-capping, a GPU); an architecture with a plan of its own (its package's native_plan.py) overrides it."""
        return NativeDecoder.build(self)

    def native_decoder(self) -> NativeDecoder | None:
        """The fused stack (`native_plan`), planned once on first use. Setting `_native = None` keeps the per-op path
        (the tests and benchmarks/engine/fused_decoder.py compare the two that way)."""
        if self._native is False:
            self._native = self.native_plan()
        return self._native  # type: ignore[return-value]

    def fused_forward(self, x: torch.Tensor, positions: torch.Tensor, attn: KVAttention,
                      lora: StepLora | None = None) -> torch.Tensor | None:
        """The final-normed hidden states of the step from the embeddings `x` through `native_decoder` in one call,
        or None where the fused stack does not take this step (the caller runs its per-op path). `lora`: the
        step's adapters, applied inside the native stack."""
        native = self.native_decoder()
        if native is None or not native.runs(attn) or (lora is not None and not native.takes_lora(lora)):
            return None
        c = self.config
        if c.attn_temperature and x.shape[0] and int(positions.max()) >= c.attn_temperature_length:
            return None  # the temperature is 1 below its length; past it, queries scale on the per-op path
        if x.shape[0] and int(positions.max()) >= self.max_positions:
            raise IndexError(f"position {int(positions.max())} is past the model's {self.max_positions}")
        return native.forward(x, positions, attn, lora)

    @classmethod
    def from_weights(cls, config: ModelConfig, source: WeightSource, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu", keep_int4: bool = True,
                     dense_prefill: bool = False) -> "LlamaModel":
        """Build the model layer by layer from a weight source (4-bit and Q8_0 weights stay quantized where
        supported; `dense_prefill` also keeps a dequantized copy of each CPU-packed one for prompt tokens)."""
        device = torch.device(device)
        source = text_part(source)

        def dense(name: str, as_dtype: torch.dtype = dtype) -> torch.Tensor:
            value = source.get(name, keep_int4=False)
            assert isinstance(value, torch.Tensor)
            return value.to(device=device, dtype=as_dtype)

        def norm(name: str) -> torch.Tensor:
            return dense(name, torch.float32)  # norms are tiny; float32 keeps them exact

        native_cpu = not use_triton(device)  # where Triton runs (or is faked to), its kernels take the weights

        def matrix(names: list[str]) -> LinearWeight:
            return load_matrix(source, names, dtype, device, keep_int4, dense_prefill)

        layers, c = [], config
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            attn = [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
            bias = None
            if c.attention_bias:
                bias = torch.cat([dense(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
            layers.append(DecoderLayer(
                input_norm=norm(p + "input_layernorm.weight"),
                qkv=matrix(attn),
                qkv_bias=bias,
                q_norm=norm(p + "self_attn.q_norm.weight") if c.qk_norm else None,
                k_norm=norm(p + "self_attn.k_norm.weight") if c.qk_norm else None,
                o_proj=matrix([p + "self_attn.o_proj.weight"]),
                post_norm=norm(p + "post_attention_layernorm.weight"),
                **cls.feed_forward(config, source, i, matrix, device, dtype),
            ))
        # On CPU in bf16 the vocabulary-sized tables are int8 per row: the output head is the biggest single
        # read of a decode step for small models, and int8 halves it (float32 mode keeps them exact).
        use_int8 = int8_supported(device, dtype)
        tied = c.tie_word_embeddings or not source.has("lm_head.weight")
        embed: torch.Tensor | Int8Weight | BlockWeight
        native_embed = block_weight(source, ["model.embed_tokens.weight"], device, dtype) if native_cpu else None
        if native_embed is not None:
            embed = native_embed
        else:
            embed_f = dense("model.embed_tokens.weight", torch.float32)
            # an untied table is read by lookups alone: bf16 rows, not per-row int8 (issue 54's drift)
            embed = Int8Weight(embed_f, dtype) if use_int8 and tied else embed_f.to(dtype)
            del embed_f
        if tied:
            lm_head: LinearWeight = embed
        else:
            lm_head = matrix(["lm_head.weight"])
            if use_int8 and isinstance(lm_head, torch.Tensor):
                lm_head = Int8Weight(lm_head, dtype)
        freq_factors = norm("rope_freqs") if source.has("rope_freqs") else None
        inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling, freq_factors)
        return cls(c, embed, layers, norm("model.norm.weight"), lm_head, inv_freq, dtype, device)

    @classmethod
    def feed_forward(cls, config: ModelConfig, source: WeightSource, i: int, matrix: Callable[[list[str]], LinearWeight],
                     device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
        """Layer i's feed-forward fields of its DecoderLayer (`matrix(names)`: the loader's linear weight of the
        tensors `names` stacked along the rows): the gated MLP's gate_up and down here."""
        p = f"model.layers.{i}."
        return dict(gate_up=matrix([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                    down=matrix([p + "mlp.down_proj.weight"]))

    def mlp(self, layer: DecoderLayer, h: torch.Tensor, prompt_rows: PromptRows | None,
            lora: StepLora | None = None, index: int = 0) -> torch.Tensor:
        """The feed-forward of `layer` (number `index`) for its normed input h [T, hidden]: the gated MLP, or its MoE
        layer; `lora`: the step's adapters beside the gated MLP's matmuls."""
        if layer.moe is not None:
            return layer.moe.forward(h)
        assert layer.gate_up is not None and layer.down is not None
        gate_up = linear(h, layer.gate_up, None, prompt_rows)
        if lora is not None:
            gate_up = lora.add(gate_up, h, index, "gate_up")
        act = silu_and_mul(gate_up)
        y = linear(act, layer.down, None, prompt_rows)
        return y if lora is None else lora.add(y, act, index, "down")

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: KVAttention,
                prompt_rows: PromptRows | None = None, lora: StepLora | None = None,
                image_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
                mrope_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] for a flat batch of T tokens at the given positions (`prompt_rows`: which
        rows are prompt tokens, for weights that keep a dense copy for them; `lora`: the step's LoRA adapters, by
        row, applied beside the base matmuls, never merged into them; `image_rows`: (flat indices, rows) whose
        embeddings an image's replace, see `merge_image_rows`).

        Qwen3-VL's image rows are [n, hidden * (1 + k)]: the embeddings, then k DeepStack features added to the
        hidden states at those rows after layers 0 .. k-1 (`deepstack_rows`). `mrope_positions` [3, T]: M-RoPE's
        (t, h, w) positions of a step with image tokens (models.mrope); such steps take the per-op path.

        On the CPU, when every weight runs on the native kernels and `attn` is the engine's paged pool, the whole
        stack runs as one native call (`native_decoder`), with the same kernels in the same order as below.

        Each residual add is fused with the norm after it (`add_rms_norm`); when the attention exposes its paged
        pool (`layer_cache` / `attend`, as the engine's PagedKVAttention does), RoPE is fused with the K/V write
        (`rope_write_kv`). Both go through kernels.dispatch: Triton on a supported GPU, the torch twins elsewhere,
        whose results are the same, bit for bit, as the unfused sequence (float32 residual stream; one rounding of
        rotated q/k to the compute dtype). No host value is read from a device tensor, so a decode step can be
        captured as a CUDA graph.
        """
        c = self.config
        eps = c.rms_norm_eps
        x = self.embed_rows(input_ids)
        if c.embed_scale is not None:  # Granite's embedding multiplier
            x = x * c.embed_scale
        x = merge_image_rows(x, image_rows)
        deepstack = deepstack_rows(image_rows, c.hidden_size)
        fused = (self.fused_forward(x, positions, attn, lora) if deepstack is None and mrope_positions is None
                 else None)
        if fused is not None:
            return fused
        if mrope_positions is not None and self.mrope_axes is not None:
            rope = mrope_cos_sin(self.cos, self.sin, mrope_positions, self.mrope_axes)
        else:
            rope = self.cos[positions], self.sin[positions]
        nope = (self.cos_nope[positions], self.sin_nope[positions]) if self.cos_nope is not None else rope
        temperature = self.attn_temperature(positions)
        paged = hasattr(attn, "layer_cache") and hasattr(attn, "attend")
        h = rms_norm(x, self.layers[0].input_norm, eps).to(self.dtype) if self.layers else x
        for i, layer in enumerate(self.layers):
            cos, sin = rope if c.rope_layers is None or c.rope_layers[i] else nope
            q, k, v = self.project_qkv(layer, h, prompt_rows, lora, i)
            o = self._attend(i, q, k, v, cos, sin, attn, paged, temperature)
            o_in, o = o, linear(o, layer.o_proj, None, prompt_rows)
            if lora is not None:
                o = lora.add(o, o_in, i, "o_proj")
            if c.residual_scale != 1.0:  # Granite's residual multiplier
                o = o * c.residual_scale
            h, x = add_rms_norm(o, x, layer.post_norm, eps, ffn_input_dtype(layer, self.dtype))
            y = self.mlp(layer, h, prompt_rows, lora, i)
            if c.residual_scale != 1.0:
                y = y * c.residual_scale
            if deepstack is not None and i < deepstack[1].shape[1]:  # added to the layer's output at the image rows
                y = y.float().index_add(0, deepstack[0], deepstack[1][:, i])
            last = i + 1 == len(self.layers)
            h, x = add_rms_norm(y, x, self.norm if last else self.layers[i + 1].input_norm, eps, self.dtype)
        return h if self.layers else rms_norm(x, self.norm, eps).to(self.dtype)

    def _attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: KVAttention, paged: bool, temperature: torch.Tensor | None) -> torch.Tensor:
        """Layer `i`'s attention output (before o_proj): RoPE on q and k, K/V written to the cache, q scaled by the
        position's temperature where the model has one (RoPE fused with the paged pool's K/V write when `paged`)."""
        if paged:
            k_cache, v_cache, slots = attn.layer_cache(i)  # type: ignore[attr-defined]
            q = rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
            if temperature is not None:
                q = (q * temperature).to(self.dtype)
            return attn.attend(i, q, **self.attend_options)  # type: ignore[attr-defined]
        q = apply_rope(q, cos, sin)
        if temperature is not None:
            q = q * temperature
        return attn(i, q.to(self.dtype), apply_rope(k, cos, sin).to(self.dtype),  # type: ignore[call-arg]
                    v.to(self.dtype), **self.attend_options)

    def attn_temperature(self, positions: torch.Tensor) -> torch.Tensor | None:
        """Ministral 3's (Llama 4's) per-token query scale [T, 1, 1], 1 + beta ln(1 + floor(pos / length)), in
        float32; None for a model without one."""
        c = self.config
        if not c.attn_temperature:
            return None
        blocks = torch.floor(positions.to(torch.float32) / c.attn_temperature_length)
        return (1 + c.attn_temperature * torch.log(1 + blocks))[:, None, None]

    def embed_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of `input_ids` [T] as float32 [T, hidden] (the residual stream stays float32 whatever the
        weights' dtype: bf16 residuals drift visibly)."""
        if not isinstance(self.embed, torch.Tensor):  # Int8Weight, BlockWeight
            return self.embed.rows(input_ids)
        return F.embedding(input_ids, self.embed).float()

    def project_qkv(self, layer: DecoderLayer, h: torch.Tensor, prompt_rows: PromptRows | None,
                    lora: StepLora | None = None, index: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer's (number `index`) q [T, H, D], k and v [T, KVH, D] from its normed input, Q/K-normed where the
        model has it; `lora`: the step's adapters beside the qkv matmul."""
        c, t = self.config, h.shape[0]
        qkv = linear(h, layer.qkv, layer.qkv_bias, prompt_rows)
        if lora is not None:
            qkv = lora.add(qkv, h, index, "qkv")
        q = qkv[:, : c.q_size].view(t, c.num_heads, c.head_dim)
        k = qkv[:, c.q_size: c.q_size + c.kv_size].view(t, c.num_kv_heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size:].view(t, c.num_kv_heads, c.head_dim)
        if layer.q_norm is not None:  # per head, as rows of head_dim (the native stack normalizes them so too)
            eps, d = c.rms_norm_eps, c.head_dim
            q = rms_norm(q.reshape(-1, d), layer.q_norm, eps).view(t, c.num_heads, d)
            k = rms_norm(k.reshape(-1, d), layer.k_norm, eps).view(t, c.num_kv_heads, d)
        return q, k, v

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [T, vocab] for hidden states [T, hidden] (divided by Granite's logits scaling, then
        soft-capped where the config says: Gemma 2, Gemma 4)."""
        logits = linear(hidden, self.lm_head).float()
        logits = logits if self.config.logit_scale == 1.0 else logits / self.config.logit_scale
        cap = self.config.final_softcap
        return logits if cap is None else softcap(logits, cap)
