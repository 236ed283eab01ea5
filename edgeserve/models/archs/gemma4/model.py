"""The Gemma 4 text decoder (dense sizes: E2B, E4B, 31B) over flat token batches and the engine's paged KV pool.

The block, from transformers' modeling_gemma4 (config fields in archs/gemma4/config.py):
  h = norm(x); q = rope(q_norm(Wq h)); k = rope(k_norm(Wk h)); v = rms(Wv h)  (no weight; V = Wk h with k_eq_v)
  x = x + post_attn_norm(Wo attention(q, k, v, scale 1))
  x = x + post_ffn_norm(down(gelu_tanh(gate h') * up h')), h' = pre_ffn_norm(x)
  E models: x = x + ple_norm(ple_proj(gelu_tanh(ple_gate x) * per_layer_input[layer]))
  x = x * layer_scalar
  26B-A4B: the MLP's output is normed and added to routed experts' (normed) before post_ffn_norm.
Sliding-window layers and global layers have their own head size, RoPE base and (global) "proportional" RoPE,
whose unrotated tail is a zero frequency here (cos 1, sin 0). The last `kv_shared_layers` layers compute only q and
attend over an earlier layer's K/V (the KV pool keeps nothing for them). The per-layer inputs (E models) are a
per-token table row per layer plus a projection of the scaled embedding, both [tokens, layers, width].

On the CPU, with every matrix in GGUF block formats, the dense block runs in the fused native stack
(models.archs.gemma4.native_plan: one native call per step), which calls the same kernels in the same order as the
per-op path below, so the two agree bit for bit; the 26B-A4B's experts keep the per-op path, which runs on every
device.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from edgeserve.kernels.cpu.decoder import NativeDecoder
from edgeserve.models.archs.gemma4.native_plan import build_gemma4
from edgeserve.kernels.dispatch import (add_rms_norm, gelu_tanh_and_mul, linear, rms_norm, rope_q, rope_write_kv,
                                        scaled_norm_add)
from edgeserve.kernels.formats.quant_linear import LinearWeight, PromptRows
from edgeserve.kernels.torch.rope import rope_cos_sin, rope_inv_freq
from edgeserve.loaders.weights import WeightSource

from edgeserve.models.archs.gemma.model import MAX_ROPE_TABLE
from edgeserve.models.attention import KVAttention
from edgeserve.models.config import ModelConfig
from edgeserve.models.decoder_scaffold import LoadedDecoder
from edgeserve.models.llama import merge_image_rows, set_decoder_fields
from edgeserve.models.moe import MoEConfig, MoELayer
from edgeserve.models.moe_weights import load_moe_layer
from edgeserve.models.text_part import RenamedWeights, language_model_prefix
from edgeserve.models.weight_loader import Table, WeightLoader, load_table, table_rows


PAD_ID = 0  # Gemma 4's `<pad>` (its configs' pad_token_id): an image token's per-layer table row is this one's


log = logging.getLogger("edgeserve.models")


@functools.cache
def _image_spans_run_per_op() -> None:
    """Say once why a prefill with images runs per op: the fused stack would open an image's bidirectional span on
    every layer, Gemma 4 opens it on the sliding layers only."""
    log.info("gemma4: prompts whose image tokens attend both ways (sliding layers only) prefill on the per-op path; "
             "the fused native stack would open them on every layer")


@dataclass
class Gemma4Layer:
    """One Gemma 4 block's weights. `qkv` stacks q, k and v (q and k with `k_eq_v`; q alone in a KV-shared layer)."""

    input_norm: torch.Tensor
    qkv: LinearWeight
    q_norm: torch.Tensor
    k_norm: torch.Tensor | None
    o_proj: LinearWeight
    post_attn_norm: torch.Tensor
    pre_ffn_norm: torch.Tensor
    post_ffn_norm: torch.Tensor
    gate_up: LinearWeight
    down: LinearWeight
    scale: float  # the learned layer output scale (`layer_scalar`)
    head_dim: int
    kv_heads: int
    window: int | None
    shared: bool  # reads an earlier layer's K/V
    k_eq_v: bool
    ple_gate: LinearWeight | None = None
    ple_proj: LinearWeight | None = None
    ple_norm: torch.Tensor | None = None
    # 26B-A4B: routed experts beside the dense MLP (its router matrix holds router.scale / sqrt(hidden))
    moe: MoELayer | None = None
    per_expert_scale: torch.Tensor | None = None
    pre_ffn_norm_2: torch.Tensor | None = None
    post_ffn_norm_1: torch.Tensor | None = None
    post_ffn_norm_2: torch.Tensor | None = None


class Gemma4Weights(RenamedWeights):
    """A WeightSource whose language-model tensors may sit under the multimodal checkpoint's
    `model.language_model.` prefix; seen under the text model's `model.` names. An HF checkpoint's experts
    (`layers.N.experts.*`, `layers.N.router.proj`) are also seen under the names edgeserve.models.moe_weights reads
    (`layers.N.mlp.experts.*`, `layers.N.mlp.gate`), as a GGUF file's are already."""

    def __init__(self, source: WeightSource):
        super().__init__(source)
        self.gguf = getattr(source, "gguf", None)
        self.prefix = language_model_prefix(source)

    def _name(self, name: str) -> str:
        if self.gguf is None:
            name = name.replace(".mlp.experts.", ".experts.").replace(".mlp.gate.weight", ".router.proj.weight")
        return self.prefix + name[len("model."):] if self.prefix and name.startswith("model.") else name

    def stored_quantized(self) -> list[str]:
        return self.source.stored_quantized()  # type: ignore[attr-defined]

    def blocks(self, name: str):
        """GGUF block bytes for the native CPU kernels (None where the source has none)."""
        blocks = getattr(self.source, "blocks", None)
        return None if blocks is None else blocks(self._name(name))


class Gemma4Model(LoadedDecoder):
    """Gemma 4 over flat token batches (LlamaModel's interface); runs over the engine's paged KV pool."""

    layers: list[Gemma4Layer]  # type: ignore[assignment]

    @classmethod
    def weight_view(cls, config: ModelConfig, source: WeightSource) -> WeightSource:
        """The language model's names (HF names, the multimodal checkpoint's, or a GGUF file's)."""
        return Gemma4Weights(source)

    @classmethod
    def load(cls, config: ModelConfig, w: WeightLoader) -> "Gemma4Model":
        """Build the model from its tensors."""
        c, src, dtype = config, w.source, w.dtype
        dev, norm, matrix = w.device, w.tensor, w.matrix
        layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            shared = c.kv_source(i) != i
            k_eq_v = c.global_k_eq_v and c.is_global(i)
            names = [a + "q_proj.weight"]
            if not shared:
                names += [a + "k_proj.weight"] + ([] if k_eq_v else [a + "v_proj.weight"])
            ple = c.per_layer_input_size > 0
            scale = norm(p + "layer_scalar") if src.has(p + "layer_scalar") else torch.ones(1)
            layers.append(Gemma4Layer(
                input_norm=norm(p + "input_layernorm.weight"),
                qkv=matrix(names),
                q_norm=norm(a + "q_norm.weight"),
                k_norm=None if shared else norm(a + "k_norm.weight"),
                o_proj=matrix([a + "o_proj.weight"]),
                post_attn_norm=norm(p + "post_attention_layernorm.weight"),
                pre_ffn_norm=norm(p + "pre_feedforward_layernorm.weight"),
                post_ffn_norm=norm(p + "post_feedforward_layernorm.weight"),
                gate_up=matrix([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                down=matrix([p + "mlp.down_proj.weight"]),
                scale=float(scale.reshape(-1)[0]),
                head_dim=c.layer_head_dim(i),
                kv_heads=c.layer_kv_heads(i),
                window=None if c.is_global(i) else c.layer_windows[i],  # type: ignore[index]
                shared=shared,
                k_eq_v=k_eq_v,
                ple_gate=matrix([p + "per_layer_input_gate.weight"]) if ple else None,
                ple_proj=matrix([p + "per_layer_projection.weight"]) if ple else None,
                ple_norm=norm(p + "post_per_layer_input_norm.weight") if ple else None,
                **(cls._moe_weights(c, src, i, matrix, norm, dev, dtype) if c.is_moe else {}),
            ))
        embed, lm_head = w.embed_and_head("model.embed_tokens.weight", c.tie_word_embeddings)
        model = cls(c, embed, layers, norm("model.norm.weight"), lm_head, dtype, dev,
                    rope_freqs=norm("rope_freqs") if src.has("rope_freqs") else None)
        if c.per_layer_input_size:
            model.ple_table = load_table(src, "model.embed_tokens_per_layer.weight", dtype, dev)
            model.ple_model_proj = matrix(["model.per_layer_model_projection.weight"])
            model.ple_proj_norm = norm("model.per_layer_projection_norm.weight")
        return model

    @staticmethod
    def _moe_weights(c: ModelConfig, src: WeightSource, i: int, matrix, norm, dev: torch.device,
                     dtype: torch.dtype) -> dict:
        """Layer i's routed experts and their norms (Gemma4Layer fields): the router's `scale` and 1 / sqrt(hidden)
        folded into its matrix's columns, softmax over all experts, the top k renormalized, then `per_expert_scale`."""
        p = f"model.layers.{i}."
        moe = load_moe_layer(c, src, i, matrix, dev, dtype, MoEConfig(
            c.num_experts, c.experts_per_token, c.moe_intermediate_size, "softmax_topk", True, "gelu_tanh"))
        moe.router = moe.router * (norm(p + "router.scale") * c.hidden_size ** -0.5)[None, :]
        return dict(moe=moe, per_expert_scale=norm(p + "router.per_expert_scale"),
                    pre_ffn_norm_2=norm(p + "pre_feedforward_layernorm_2.weight"),
                    post_ffn_norm_1=norm(p + "post_feedforward_layernorm_1.weight"),
                    post_ffn_norm_2=norm(p + "post_feedforward_layernorm_2.weight"))

    def __init__(self, config: ModelConfig, embed: Table, layers: list[Gemma4Layer], norm: torch.Tensor,
                 lm_head: LinearWeight, dtype: torch.dtype, device: torch.device,
                 rope_freqs: torch.Tensor | None = None):
        """`rope_freqs`: a GGUF file's per-frequency divisors of the global layers' RoPE (llama.cpp writes
        proportional RoPE so: 1 for rotated pairs, 1e30 for the rest); without it, `rope_global_partial` says."""
        c = config
        set_decoder_fields(self, c, embed, layers, norm, lm_head, dtype, device)
        self._native: NativeDecoder | None | bool = False  # the fused native stack, planned on the first forward
        self.max_positions = min(c.max_position_embeddings, MAX_ROPE_TABLE)
        global_dim = c.global_head_dim or c.head_dim
        inv = rope_inv_freq(global_dim, c.rope_theta, None, rope_freqs)
        if rope_freqs is None and c.rope_global_partial < 1.0:
            inv[int(c.rope_global_partial * global_dim // 2):] = 0.0  # "proportional": the tail does not rotate
        self.cos, self.sin = (t.to(device) for t in rope_cos_sin(inv, self.max_positions))
        local = rope_inv_freq(c.head_dim, c.rope_local_theta or 10_000.0, None, None)
        self.cos_local, self.sin_local = (t.to(device) for t in rope_cos_sin(local, self.max_positions))
        self.embed_scale = float(c.embed_scale or 1.0)
        self.ple_table: Table | None = None
        self.ple_model_proj: LinearWeight | None = None
        self.ple_proj_norm: torch.Tensor | None = None
        self._v_norm = {d: torch.ones(d, device=device) for d in {layer.head_dim for layer in layers}}
        self._unit = torch.ones(c.hidden_size, device=device)  # the router's weightless RMSNorm (MoE)

    def native_plan(self) -> NativeDecoder | None:
        """The fused plan (models.archs.gemma4.native_plan); None where it does not apply."""
        return build_gemma4(self)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """The E models' per-layer inputs [T, layers, width] (float32): each token's row of the per-layer table
        (scaled by sqrt(width)) plus the normed projection of its scaled embedding `x`, over sqrt(2)."""
        c = self.config
        if not c.per_layer_input_size:
            return None
        t, n, w = x.shape[0], c.num_layers, c.per_layer_input_size
        rows = table_rows(self.ple_table, input_ids).reshape(t * n, w)  # type: ignore[arg-type]
        proj = linear(self.matmul_input(x), self.ple_model_proj).float().reshape(t * n, w)  # type: ignore[arg-type]
        # one native pass on CPU: torch's own threads on these [T, layers * width] ops stall beside the kernels'
        return scaled_norm_add(proj, rows, self.ple_proj_norm, c.rms_norm_eps, c.hidden_size ** -0.5, w ** 0.5,
                               2.0 ** -0.5).view(t, n, w)  # type: ignore[arg-type]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: KVAttention,
                prompt_rows: PromptRows | None = None,
                image_rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] for a flat batch of T tokens at the given positions, over the
        engine's paged KV pool (`attn` exposing `layer_cache` / `attend`, as PagedKVAttention does); `image_rows`:
        (flat indices, rows) whose embeddings an image's replace (an E model's per-layer inputs there are the padding
        token's table rows with the image rows' projection, as transformers' Gemma4Model makes them)."""
        if not (hasattr(attn, "layer_cache") and hasattr(attn, "attend")):
            raise TypeError("Gemma 4 runs over the paged KV pool (edgeserve.engine.cache.kv_cache.PagedKVAttention)")
        t = input_ids.shape[0]
        if t and int(positions.max()) >= self.max_positions:
            raise IndexError(f"position {int(positions.max())} is past the model's {self.max_positions}")
        x = merge_image_rows(self.embed_rows(input_ids) * self.embed_scale, image_rows)
        ple = self.per_layer_inputs(input_ids if image_rows is None else input_ids.index_fill(0, image_rows[0], PAD_ID),
                                    x)
        native = self.native_decoder()
        spans = getattr(getattr(attn, "meta", None), "attend_spans", None)
        if native is not None and spans is None and native.runs(attn):
            return native.forward(x, positions, attn, per_layer=ple)
        if native is not None and spans is not None:
            _image_spans_run_per_op()
        return self.layer_stack(x, positions, attn, ple, prompt_rows)

    def layer_stack(self, x: torch.Tensor, positions: torch.Tensor, attn: KVAttention, ple: torch.Tensor | None = None,
                    prompt_rows: PromptRows | None = None) -> torch.Tensor:
        """The layers, per op, over the residual stream x [T, hidden] (float32): the final-normed hidden states.
        A KV-shared layer reads `attn.layer_cache(i)` / `attn.attend(i, ...)` of its own index i (the pool sends it
        to its source; a Gemma 4 assistant's view sends it to the target's layer)."""
        c = self.config
        eps, t, heads = c.rms_norm_eps, x.shape[0], c.num_heads
        rope_global = self.cos[positions], self.sin[positions]
        rope_local = self.cos_local[positions], self.sin_local[positions]
        act = self.act_dtype  # the normed rows the matmuls read: float32 on the CPU (issue 54)
        h = rms_norm(x, self.layers[0].input_norm, eps).to(act)
        for i, layer in enumerate(self.layers):
            d = layer.head_dim
            cos, sin = rope_global if layer.window is None else rope_local
            qkv = linear(h, layer.qkv, None, prompt_rows)
            q = rms_norm(qkv[:, : heads * d].reshape(-1, d), layer.q_norm, eps).view(t, heads, d)
            k_cache, v_cache, slots = attn.layer_cache(i)  # type: ignore[attr-defined]
            if layer.shared:  # attends over its source layer's K/V, written earlier in this step
                q = rope_q(q, cos, sin, k_cache, self.dtype)
            else:
                kv = layer.kv_heads * d
                k = qkv[:, heads * d: heads * d + kv].reshape(-1, d)
                v = k if layer.k_eq_v else qkv[:, heads * d + kv:].reshape(-1, d)
                k = rms_norm(k, layer.k_norm, eps).view(t, layer.kv_heads, d)  # type: ignore[arg-type]
                v = rms_norm(v, self._v_norm[d], eps).view(t, layer.kv_heads, d)
                q = rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
            o = attn.attend(i, q, window=layer.window, scale=1.0,  # type: ignore[attr-defined]
                            spans=layer.window is not None)
            o = rms_norm(linear(o, layer.o_proj, None, prompt_rows), layer.post_attn_norm, eps)
            h, x = add_rms_norm(o, x, layer.pre_ffn_norm, eps, act)
            y = linear(gelu_tanh_and_mul(linear(h, layer.gate_up, None, prompt_rows)), layer.down, None, prompt_rows)
            if layer.moe is not None:
                y = rms_norm(y, layer.post_ffn_norm_1, eps) + self._experts(layer, x)
            y = rms_norm(y, layer.post_ffn_norm, eps)
            nxt = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            if ple is None and layer.scale == 1.0:
                h, x = add_rms_norm(y, x, nxt, eps, act)
                continue
            x = x + y
            if ple is not None:
                x = x + self._per_layer_input(layer, x, ple[:, i], prompt_rows)
            if layer.scale != 1.0:
                x = x * layer.scale
            h = rms_norm(x, nxt, eps).to(act)
        return h

    def _per_layer_input(self, layer: Gemma4Layer, x: torch.Tensor, ple: torch.Tensor,
                         prompt_rows: PromptRows | None) -> torch.Tensor:
        """What an E model's layer adds to the residual stream x from its per-layer input `ple` [T, width]:
        the normed projection of gelu_tanh(gate(x)) * ple."""
        gate = linear(self.matmul_input(x), layer.ple_gate, None, prompt_rows).float()  # type: ignore[arg-type]
        g = gelu_tanh_and_mul(torch.cat([gate, ple], dim=-1))
        g = linear(self.matmul_input(g), layer.ple_proj, None, prompt_rows)  # type: ignore[arg-type]
        return rms_norm(g, layer.ple_norm, self.config.rms_norm_eps)  # type: ignore[arg-type]

    def _experts(self, layer: Gemma4Layer, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' normed output (float32 [T, hidden]) for the residual stream x: routed on x's
        weightless RMSNorm, run on its `pre_ffn_norm_2` norm."""
        eps = self.config.rms_norm_eps
        weights, experts = layer.moe.route(rms_norm(x, self._unit, eps))  # type: ignore[union-attr]
        weights = weights * layer.per_expert_scale[experts]  # type: ignore[index]
        h = rms_norm(x, layer.pre_ffn_norm_2, eps).to(self.act_dtype)  # type: ignore[arg-type]
        y = layer.moe.mix(h, weights, experts)  # type: ignore[union-attr]
        return rms_norm(y, layer.post_ffn_norm_2, eps)  # type: ignore[arg-type]


def model_class(config: ModelConfig) -> type[Gemma4Model]:
    """Gemma 4's block (edgeserve.models.registry's hook; its native plan: models.archs.gemma4.native_plan)."""
    return Gemma4Model


def dummy_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF names and shapes of Gemma 4's tensors, for random weights (edgeserve.models.dummy): each layer's own
    head size and K/V heads, no K/V in the shared layers, no V in a K = V layer, its MLP width, the per-layer inputs,
    and the 26B-A4B's experts beside the MLP."""
    c, h = config, config.hidden_size
    from edgeserve.models.dummy import top_shapes

    shapes = top_shapes(c)
    ple = c.per_layer_input_size
    if ple:
        shapes.update({"model.embed_tokens_per_layer.weight": (c.vocab_size, c.num_layers * ple),
                       "model.per_layer_model_projection.weight": (c.num_layers * ple, h),
                       "model.per_layer_projection_norm.weight": (ple,)})
    for i in range(c.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        d, q, kv = c.layer_head_dim(i), c.num_heads * c.layer_head_dim(i), c.layer_kv_heads(i) * c.layer_head_dim(i)
        ffn = c.layer_intermediate[i] if c.layer_intermediate else c.intermediate_size
        shapes.update({a + "q_proj.weight": (q, h), a + "q_norm.weight": (d,), a + "o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                       p + "mlp.down_proj.weight": (h, ffn)})
        shapes.update({p + n: (h,) for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                             "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")})
        if c.kv_source(i) == i:
            shapes.update({a + "k_proj.weight": (kv, h), a + "k_norm.weight": (d,)})
            if not (c.global_k_eq_v and c.is_global(i)):
                shapes[a + "v_proj.weight"] = (kv, h)
        if ple:
            shapes.update({p + "per_layer_input_gate.weight": (ple, h), p + "per_layer_projection.weight": (h, ple),
                           p + "post_per_layer_input_norm.weight": (h,)})
        if c.is_moe:
            shapes.update(_dummy_expert_shapes(c, p))
    return shapes


def _dummy_expert_shapes(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """A 26B-A4B layer's experts, router and their norms under HF names."""
    e, f, h, p = config.num_experts, config.moe_intermediate_size, config.hidden_size, prefix
    shapes: dict[str, tuple[int, ...]] = {p + "experts.gate_up_proj": (e, 2 * f, h), p + "experts.down_proj": (e, h, f),
                                          p + "router.proj.weight": (e, h), p + "router.scale": (h,),
                                          p + "router.per_expert_scale": (e,)}
    shapes.update({p + n: (h,) for n in ("pre_feedforward_layernorm_2.weight", "post_feedforward_layernorm_1.weight",
                                         "post_feedforward_layernorm_2.weight")})
    return shapes
