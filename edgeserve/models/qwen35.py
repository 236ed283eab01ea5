"""The Qwen3.5 / 3.6 hybrid decoder (dense `qwen35` and MoE `qwen35moe`) over flat token batches.

Each layer is x = x + mixer(norm(x)); x = x + ffn(norm(x)), the mixer being either
  - a Gated DeltaNet layer (kernels.torch.gated_delta): in_proj_qkv / z / b / a (one stacked matmul here), the causal conv,
    the gated delta rule over the sequence's recurrent state, the gated RMSNorm, out_proj; it keeps no KV, only the
    per-sequence state in a slot of the engine's StatePool (`attn.states`: a `RecurrentStates`), or
  - gated full attention: q_proj gives [q | gate] per head, Q/K RMSNorm, RoPE on the first `rotary_dim` dims of each
    head, paged attention, output times sigmoid(gate), o_proj.
The feed-forward is a gated MLP or the MoE layer (routed experts plus a sigmoid-gated shared expert). Every RMSNorm but
the DeltaNet's multiplies by 1 + w (`ModelConfig.norm_offset` adds the 1 to an HF checkpoint's weights).

Partial RoPE runs on the full-width RoPE kernels: the q / k rows of each head are permuted at load so that the rotated
dims' rotate-half pairs (i, i + r/2) become the full head's pairs (i, i + D/2), with a zero frequency (no rotation) on
the other pairs; q . k is unchanged by a permutation applied to both, and V / the output are not touched.

On the CPU, with every matrix in GGUF block formats, the block runs in the fused native stack
(models.archs.qwen35.native_plan: one native call per step, the recurrent states updated in place in the state pool),
which calls the same kernels in the same order as the per-op path here, so the two agree bit for bit; the MoE block's
feed-forward enters it as the same moe_layer.c plan its MoELayer runs per-op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from edgeserve.errors import ModelLoadError
from edgeserve.kernels.cpu.decoder import NativeDecoder
from edgeserve.models.archs.qwen35.native_plan import build_qwen35
from edgeserve.kernels.dispatch import (add_rms_norm, gated_delta_net, head_rms_norm, linear, rms_norm, rope_write_kv,
                                        sigmoid_gate)
from edgeserve.kernels.torch.gated_delta import DeltaBatch, DeltaNetDims, DeltaNetWeights
from edgeserve.kernels.formats.quant_linear import LinearWeight, PromptRows
from edgeserve.kernels.torch.rope import rope_permutation
from edgeserve.loaders.weights import WeightSource, WeightValue

from .attention import KVAttention
from .config import ModelConfig
from .archs.gemma4.model import load_table
from .llama import LlamaModel, load_matrix, set_rotary_decoder_fields
from .moe import MoELayer, ffn_input_dtype
from .moe_weights import load_moe_layer
from .mtp_head import MtpHead, attach_mtp_head
from .text_part import RenamedWeights, language_model_prefix


class RecurrentStates(Protocol):
    """The step's recurrent states as the model reads them: the ragged batch (each sequence's rows and slot) and
    linear layer j's (conv [slots, K - 1, C], recurrent [slots, Hv, Dk, Dv]) pools."""

    batch: DeltaBatch

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class Qwen35Layer:
    """One block's weights: a Gated DeltaNet mixer (`in_proj` stacks qkv, z, b, a; `delta` its small weights) or
    gated attention (`qkv`: [q | gate] per head, then k, v), and a gated MLP or MoE feed-forward."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    gate_up: LinearWeight | None
    down: LinearWeight | None
    moe: MoELayer | None = None
    # full attention
    qkv: LinearWeight | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    o_proj: LinearWeight | None = None
    # Gated DeltaNet
    linear_index: int = -1  # its index among the linear layers (its layer of the state pool)
    in_proj: LinearWeight | None = None
    out_proj: LinearWeight | None = None
    delta: DeltaNetWeights | None = None


def partial_rope_inv_freq(head_dim: int, rotary_dim: int, theta: float) -> torch.Tensor:
    """[head_dim // 2] inverse frequencies for the permuted heads: RoPE's over `rotary_dim`, then zeros."""
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    return torch.cat([inv, torch.zeros(head_dim // 2 - rotary_dim // 2, dtype=torch.float64)]).float()


class Qwen35Weights(RenamedWeights):
    """A WeightSource over an HF checkpoint (text model or the multimodal one's `model.language_model.`) or a
    qwen35 GGUF, seen under the text model's names, with the attention q / k rows (and Q/K norm weights) in the
    partial-RoPE order of `rope_permutation`."""

    def __init__(self, source: WeightSource, config: ModelConfig):
        super().__init__(source)
        self.gguf = getattr(source, "gguf", None)
        self.prefix = language_model_prefix(source)
        c = config
        perm = rope_permutation(c.head_dim, c.rotary_dim or c.head_dim)
        self._perm = None if torch.equal(perm, torch.arange(c.head_dim)) else perm
        d = c.head_dim
        if self._perm is not None:
            q_rows = torch.arange(c.num_heads * 2 * d).view(c.num_heads, 2, d)
            q_rows[:, 0] = q_rows[:, 0][:, self._perm]
            self._rows = {"q_proj": q_rows.reshape(-1),
                          "k_proj": torch.arange(c.num_kv_heads * d).view(-1, d)[:, self._perm].reshape(-1)}

    def _name(self, name: str) -> str:
        return self.prefix + name[len("model."):] if self.prefix and name.startswith("model.") else name

    def _permuted(self, name: str, value):
        if self._perm is None:
            return value
        for proj in ("q_proj", "k_proj"):
            if name.endswith(f"self_attn.{proj}.weight"):
                return value.rows(self._rows[proj]) if not isinstance(value, torch.Tensor) else value[self._rows[proj]]
        if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            return value[self._perm]
        return value

    def get(self, name: str, keep_int4: bool) -> WeightValue:
        return self._permuted(name, super().get(name, keep_int4))

    def blocks(self, name: str):
        """GGUF block bytes for the native CPU kernels (None where the source has none)."""
        blocks = getattr(self.source, "blocks", None)
        found = None if blocks is None else blocks(self._name(name))
        return None if found is None else self._permuted(name, found)

    def stored_quantized(self) -> list[str]:
        return self.source.stored_quantized()  # type: ignore[attr-defined]


class Qwen35Model(LlamaModel):
    """Qwen3.5 over flat token batches (LlamaModel's interface): runs over the engine's paged KV pool with the
    step's recurrent states beside it (`attn.states`)."""

    layers: list[Qwen35Layer]  # type: ignore[assignment]
    mtp: MtpHead | None = None  # the multi-token-prediction head, where the file has one (models.mtp_head)
    mtp_error: str | None = None  # why a file's MTP block could not be read

    @classmethod
    def from_weights(cls, config: ModelConfig, source: WeightSource, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu", keep_int4: bool = True,
                     dense_prefill: bool = False) -> "Qwen35Model":
        """Build the model from a weight source (an HF checkpoint's names or a qwen35 GGUF file's)."""
        dev = torch.device(device)
        c = config
        if c.delta is None or c.linear_layers is None:
            raise ModelLoadError(f"{c.architecture} config has no linear-attention layer shape")
        src = Qwen35Weights(source, c)
        is_gguf = src.gguf is not None

        def tensor(name: str) -> torch.Tensor:
            value = src.get(name, keep_int4=False)
            assert isinstance(value, torch.Tensor)
            return value.to(device=dev, dtype=torch.float32)

        def norm(name: str) -> torch.Tensor:
            return tensor(name) + c.norm_offset

        def matrix(names: list[str]) -> LinearWeight:
            return load_matrix(src, names, dtype, dev, keep_int4, dense_prefill)

        layers, linear_index = [], 0
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            ffn = cls._feed_forward(c, src, i, matrix, dev, dtype)
            layer = Qwen35Layer(input_norm=norm(p + "input_layernorm.weight"),
                                post_norm=norm(p + "post_attention_layernorm.weight"), **ffn)
            if c.is_linear(i):
                a = p + "linear_attn."
                layer.linear_index = linear_index
                linear_index += 1
                layer.in_proj = matrix([a + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")])
                layer.out_proj = matrix([a + "out_proj.weight"])
                layer.delta = cls._delta_weights(c.delta, a, tensor, is_gguf, c.rms_norm_eps, i)
            else:
                a = p + "self_attn."
                layer.qkv = matrix([a + f"{x}_proj.weight" for x in "qkv"])
                layer.q_norm, layer.k_norm = norm(a + "q_norm.weight"), norm(a + "k_norm.weight")
                layer.o_proj = matrix([a + "o_proj.weight"])
            layers.append(layer)
        untied = not c.tie_word_embeddings and src.has("lm_head.weight")
        embed = load_table(src, "model.embed_tokens.weight", dtype, dev, int8=not untied)
        lm_head: LinearWeight = embed
        if untied:
            lm_head = matrix(["lm_head.weight"])
        inv_freq = partial_rope_inv_freq(c.head_dim, c.rotary_dim or c.head_dim, c.rope_theta)
        model = cls(c, embed, layers, norm("model.norm.weight"), lm_head, inv_freq, dtype, dev)
        attach_mtp_head(model, src, keep_int4, dense_prefill)  # the MTP block, for speculation (engine.spec.mtp)
        return model

    @staticmethod
    def _feed_forward(c: ModelConfig, src: WeightSource, i: int, matrix, dev: torch.device,
                      dtype: torch.dtype) -> dict:
        """Layer i's Qwen35Layer feed-forward fields: the MoE layer, or the gated MLP."""
        if c.is_moe:
            moe = load_moe_layer(c, src, i, matrix, dev, dtype)
            if moe.shared is not None and moe.shared.gate is not None:  # a GGUF may keep it 1-D [hidden]
                moe.shared.gate = moe.shared.gate.reshape(1, -1)
            return dict(gate_up=None, down=None, moe=moe)
        p = f"model.layers.{i}.mlp."
        return dict(gate_up=matrix([p + "gate_proj.weight", p + "up_proj.weight"]),
                    down=matrix([p + "down_proj.weight"]))

    @staticmethod
    def _delta_weights(dims: DeltaNetDims, a: str, tensor, is_gguf: bool, eps: float, i: int) -> DeltaNetWeights:
        """A DeltaNet layer's conv weight [C, K], A_log, dt_bias and gated-norm weight, checked against `dims`."""
        conv = tensor(a + "conv1d.weight")
        conv = conv.reshape(conv.shape[0], -1)  # HF [C, 1, K]; GGUF [C, K]
        # llama.cpp stores -exp(A_log) as ssm_a
        a_log = torch.log(-tensor(a + "ssm_a")) if is_gguf else tensor(a + "A_log")
        weights = DeltaNetWeights(conv, a_log.reshape(-1), tensor(a + "dt_bias").reshape(-1),
                                  tensor(a + "norm.weight").reshape(-1), eps)
        want = {"conv": (dims.conv_dim, dims.conv_kernel), "A_log": (dims.num_v_heads,),
                "dt_bias": (dims.num_v_heads,), "norm": (dims.head_v_dim,)}
        got = {"conv": tuple(conv.shape), "A_log": tuple(weights.A_log.shape),
               "dt_bias": tuple(weights.dt_bias.shape), "norm": tuple(weights.norm_weight.shape)}
        for key, shape in want.items():
            if got[key] != shape:
                raise ModelLoadError(f"layer {i}: linear-attention {key} has shape {got[key]}, expected {shape}")
        return weights

    def __init__(self, config: ModelConfig, embed, layers: list[Qwen35Layer], norm: torch.Tensor,
                 lm_head: LinearWeight, inv_freq: torch.Tensor, dtype: torch.dtype, device: torch.device):
        set_rotary_decoder_fields(self, config, embed, layers, norm, lm_head, inv_freq, dtype, device)

    def native_plan(self) -> NativeDecoder | None:
        """The fused plan (models.archs.qwen35.native_plan); None where it does not apply (weights or experts not in
        block formats, a GPU)."""
        return build_qwen35(self)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: KVAttention,
                prompt_rows: PromptRows | None = None) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] for a flat batch of T tokens, over the engine's paged KV pool
        (`attn` exposing `layer_cache` / `attend`) and its recurrent states (`attn.states`)."""
        states: RecurrentStates | None = getattr(attn, "states", None)
        if not (hasattr(attn, "layer_cache") and hasattr(attn, "attend")) or states is None:
            raise TypeError("Qwen3.5 runs over the paged KV pool with recurrent states beside it "
                            "(PagedKVAttention with `states`)")
        c = self.config
        eps, t = c.rms_norm_eps, input_ids.shape[0]
        if t and int(positions.max()) >= self.max_positions:
            raise IndexError(f"position {int(positions.max())} is past the model's {self.max_positions}")
        x = self.embed_rows(input_ids)
        native = self.native_decoder()
        if native is not None and native.runs(attn) and native.recurrent.takes(states, t):  # type: ignore[union-attr]
            return native.forward(x, positions, attn)
        cos, sin = self.cos[positions], self.sin[positions]
        act = self.act_dtype
        h = rms_norm(x, self.layers[0].input_norm, eps).to(act)
        for i, layer in enumerate(self.layers):
            if layer.delta is not None:
                y = self._delta_net(layer, h, states, prompt_rows)
            else:
                y = self._attention(i, layer, h, cos, sin, attn, prompt_rows)
            h, x = add_rms_norm(y, x, layer.post_norm, eps, ffn_input_dtype(layer, act))
            y = self.mlp(layer, h, prompt_rows)  # type: ignore[arg-type]
            last = i + 1 == len(self.layers)
            h, x = add_rms_norm(y, x, self.norm if last else self.layers[i + 1].input_norm, eps, act)
        return h

    def _delta_net(self, layer: Qwen35Layer, h: torch.Tensor, states: RecurrentStates,
                   prompt_rows: PromptRows | None) -> torch.Tensor:
        """A Gated DeltaNet mixer's output [T, hidden], advancing each sequence's state in its slot."""
        d = self.config.delta
        assert d is not None and layer.in_proj is not None and layer.delta is not None
        proj = linear(h, layer.in_proj, None, prompt_rows)
        mixed, z, b, a = proj.split([d.conv_dim, d.value_dim, d.num_v_heads, d.num_v_heads], dim=-1)
        conv_state, recurrent = states.layer(layer.linear_index)
        o = gated_delta_net(mixed, z, a, b, layer.delta, d, conv_state, recurrent, states.batch)
        return linear(self.matmul_input(o), layer.out_proj, None, prompt_rows)  # type: ignore[arg-type]

    def _attention(self, i: int, layer: Qwen35Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   attn, prompt_rows: PromptRows | None) -> torch.Tensor:
        """A gated full-attention mixer's output [T, hidden] (K/V written to layer i's pool)."""
        c = self.config
        t, heads, d, kv = h.shape[0], c.num_heads, c.head_dim, c.num_kv_heads
        qkv = linear(h, layer.qkv, None, prompt_rows)  # type: ignore[arg-type]
        qg = qkv[:, : 2 * heads * d].view(t, heads, 2 * d)  # views of the projection: the kernels read them in place
        q = head_rms_norm(qg[:, :, :d], layer.q_norm, c.rms_norm_eps)  # type: ignore[arg-type]
        k = head_rms_norm(qkv[:, 2 * heads * d: 2 * heads * d + c.kv_size].view(t, kv, d), layer.k_norm,  # type: ignore
                          c.rms_norm_eps)
        v = qkv[:, 2 * heads * d + c.kv_size:].view(t, kv, d)
        k_cache, v_cache, slots = attn.layer_cache(i)
        q = rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
        o = sigmoid_gate(attn.attend(i, q).view(t, heads, d), qg[:, :, d:]).view(t, heads * d)
        return linear(self.matmul_input(o), layer.o_proj, None, prompt_rows)  # type: ignore[arg-type]
