"""The Nemotron-H decoder over flat token batches (LlamaModel's interface).

Each block is x = x + mixer(norm(x)); the final norm is `norm_f`. The mixer is one of
  - Mamba-2 (kernels.torch.mamba2.mamba2_mixer): in_proj gives [z | x B C | dt]; a causal depthwise conv (with bias) and
    SiLU over x B C continuing from the sequence's conv state, the SSD recurrence continuing from its ssm state
    (both in a slot of the engine's StatePool, `attn.states`), a gated group RMSNorm, then out_proj; no KV,
  - GQA attention over the paged KV pool, without positional encoding, then o_proj,
  - a squared-ReLU MLP (up, down); no KV, no state,
  - (nemotron_h_moe) routed squared-ReLU experts beside a shared squared-ReLU MLP, one edgeserve.models.moe layer
    (non-gated, its "sigmoid_bias" router: moe_layer.c's ROUTE_SIGMOID_BIAS on the CPU): the router's sigmoids plus
    a correction bias choose the top k, their sigmoids (renormalized) times the routed scaling factor weigh them; no
    KV, no state.
On the CPU with every matrix in GGUF block formats the model (MoE blocks too) runs in the fused native stack
(archs.nemotron_h.native_plan), else per-op.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cached_property

import torch

from edgeserve.kernels.dispatch import add_rms_norm, linear, rms_norm, ssd_scan
from edgeserve.kernels.torch.mamba2 import Mamba2Dims, mamba2_mixer
from edgeserve.kernels.formats.quant_linear import LinearWeight, PromptRows
from edgeserve.loaders.weights import WeightSource
from edgeserve.models.attention import KVAttention
from edgeserve.models.config import ModelConfig
from edgeserve.models.decoder_scaffold import PerOpHybridDecoder, next_norm, step_states
from edgeserve.models.llama import LlamaModel
from edgeserve.models.moe import MoEConfig, MoELayer, SharedExpert
from edgeserve.models.moe_weights import load_moe_layer
from edgeserve.models.text_part import RenamedWeights
from edgeserve.models.weight_loader import WeightLoader

from .config import mamba2_dims


class BackboneWeights(RenamedWeights):
    """An HF Nemotron-H checkpoint (`backbone.*`) under the `model.*` names the model reads (a MoE block's router and
    experts, `mixer.*`, under the shared MoE loader's `mlp.*`)."""

    def _name(self, name: str) -> str:
        if not name.startswith("model."):
            return name
        return "backbone." + name[len("model."):].replace(".mlp.", ".mixer.", 1)

    def blocks(self, name: str):
        """GGUF block bytes (an HF source has none)."""
        return None


@dataclass
class Mamba2Weights:
    """A Mamba-2 mixer's weights: conv [conv_dim, K] and its bias, dt_bias, A (= -exp(A_log)) and D [H], the gated
    norm's weight [H * P] (None: y * silu(z) without a norm, Falcon-H1's `mamba_rms_norm` off)."""

    in_proj: LinearWeight
    conv: torch.Tensor
    conv_bias: torch.Tensor | None
    dt_bias: torch.Tensor
    A: torch.Tensor
    D: torch.Tensor
    norm: torch.Tensor | None
    out_proj: LinearWeight


@dataclass
class NemotronHLayer:
    """One block: its pre-norm and exactly one mixer (Mamba-2 with its state index, attention, or the MLP)."""

    input_norm: torch.Tensor
    mamba: Mamba2Weights | None = None
    state_index: int = -1  # its index among the Mamba-2 layers (its layer of the state pool)
    qkv: LinearWeight | None = None
    o_proj: LinearWeight | None = None
    up: LinearWeight | None = None  # the MLP's
    down: LinearWeight | None = None
    moe: MoELayer | None = None  # a MoE block: routed experts, their choice bias and the shared expert


def load_mamba2(dims: Mamba2Dims, src: WeightSource, m: str, vector, matrix, is_gguf: bool) -> Mamba2Weights:
    """A Mamba-2 mixer's weights under prefix `m` (`vector` / `matrix` load one; A from llama.cpp's ssm_a, or -exp
    of HF's A_log). Granite 4 H's and Falcon-H1's layers load theirs through it too."""
    conv = vector(m + "conv1d.weight").reshape(dims.conv_dim, dims.conv_kernel)
    a = vector(m + "ssm_a") if is_gguf else -torch.exp(vector(m + "A_log"))
    bias, norm = m + "conv1d.bias", m + "norm.weight"
    return Mamba2Weights(in_proj=matrix([m + "in_proj.weight"]), conv=conv,
                         conv_bias=vector(bias) if src.has(bias) else None, dt_bias=vector(m + "dt_bias"),
                         A=a, D=vector(m + "D"), norm=vector(norm) if src.has(norm) else None,
                         out_proj=matrix([m + "out_proj.weight"]))


def run_mamba2(model: LlamaModel, w: Mamba2Weights, index: int, h: torch.Tensor, states,
               prompt_rows: PromptRows | None) -> torch.Tensor:
    """A Mamba-2 mixer's output [T, hidden] for its normed input h, through state layer `index` of the step's
    states (`model.dims`: the layers' shape)."""
    conv_state, ssm_state = states.layer(index)
    y = mamba2_mixer(linear(h, w.in_proj, None, prompt_rows), model.dims, w.conv, w.conv_bias, w.dt_bias, w.A,
                     w.D, w.norm, model.config.rms_norm_eps, conv_state, ssm_state, states.batch, ssd_scan)
    return linear(model.matmul_input(y), w.out_proj, None, prompt_rows)


class Mamba2HybridDecoder(PerOpHybridDecoder):
    """A decoder with Mamba-2 layers (Nemotron-H, Granite 4 H), their shape as `dims` (run_mamba2 reads it); one
    whose `native_plan` gives a plan runs on the fused native stack where the plan fits, else per-op."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._native = False  # the fused native stack, planned on the first forward

    @cached_property
    def dims(self) -> Mamba2Dims:
        """The Mamba-2 layers' shape."""
        return mamba2_dims(self.config)

    # (module, function) of the architecture's fused plan, imported on first use; None: always per-op
    plan_builder: tuple[str, str] | None = None

    def native_plan(self):
        """The fused plan of this model (`plan_builder`'s), or None where it has none or it does not fit."""
        if self.plan_builder is None:
            return None
        module, name = self.plan_builder
        return getattr(importlib.import_module(module), name)(self)

    def native_forward(self, x: torch.Tensor, positions: torch.Tensor, attn, states) -> torch.Tensor | None:
        """The step's final-normed hidden states from the embeddings `x` on the fused stack, or None where the step
        does not take it (no plan, another pool, states it does not run over)."""
        native = self.native_decoder()
        if native is None or not native.runs(attn) or not native.recurrent.takes(states, x.shape[0]):
            return None
        return native.forward(x, positions, attn)


class NemotronHModel(Mamba2HybridDecoder):
    """Nemotron-H over the engine's paged KV pool with the step's Mamba-2 states beside it (`attn.states`)."""

    layers: list[NemotronHLayer]  # type: ignore[assignment]
    plan_builder = ("edgeserve.models.archs.nemotron_h.native_plan", "build_nemotron_h")

    @classmethod
    def weight_view(cls, config: ModelConfig, source: WeightSource) -> WeightSource:
        """An HF checkpoint's `backbone.*` names as `model.*`; a nemotron_h GGUF's as they are."""
        is_gguf = getattr(source, "gguf", None) is not None
        return source if is_gguf or source.has("model.embeddings.weight") else BackboneWeights(source)

    @classmethod
    def load(cls, config: ModelConfig, w: WeightLoader) -> "NemotronHModel":
        """Build the model from its tensors (Mamba-2, attention and MLP blocks)."""
        c, src = config, w.source
        is_gguf = getattr(src, "gguf", None) is not None
        dims, layers, index = mamba2_dims(c), [], 0
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            m = p + "mixer."
            layer = NemotronHLayer(input_norm=w.vector(p + "norm.weight"))
            if c.is_linear(i):
                layer.mamba, layer.state_index, index = load_mamba2(dims, src, m, w.vector, w.matrix, is_gguf), \
                    index, index + 1
            elif c.keeps_kv(i):
                layer.qkv = w.matrix([m + f"{x}_proj.weight" for x in "qkv"])
                layer.o_proj = w.matrix([m + "o_proj.weight"])
            elif c.is_moe and src.has(p + "mlp.gate.weight"):
                layer.moe = load_moe_layer(c, src, i, w.matrix, w.device, w.dtype, nemotron_moe_config(c),
                                           w.vector(m + "gate.e_score_correction_bias"))
                s = m + "shared_experts."
                layer.moe.shared = SharedExpert(w.matrix([s + "up_proj.weight"]), w.matrix([s + "down_proj.weight"]),
                                                activation="relu2")
            else:
                layer.up, layer.down = w.matrix([m + "up_proj.weight"]), w.matrix([m + "down_proj.weight"])
            layers.append(layer)
        embed, lm_head = w.embed_and_head("model.embeddings.weight", c.tie_word_embeddings)
        return cls(c, embed, layers, w.vector("model.norm_f.weight"), lm_head, w.dtype, w.device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: KVAttention,
                prompt_rows: PromptRows | None = None) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] for a flat batch of T tokens, over the engine's paged KV pool
        (`attn` exposing `layer_cache` / `attend`) and its Mamba-2 states (`attn.states`)."""
        states = step_states(attn, positions, self.max_positions, "Nemotron-H", "Mamba-2", needs=("__call__",))
        c = self.config
        eps = c.rms_norm_eps
        x = self.embed_rows(input_ids)
        fused = self.native_forward(x, torch.zeros_like(positions), attn, states)  # no positional encoding
        if fused is not None:
            return fused
        h = rms_norm(x, self.layers[0].input_norm, eps).to(self.dtype)
        for i, layer in enumerate(self.layers):
            if layer.mamba is not None:
                y = run_mamba2(self, layer.mamba, layer.state_index, h, states, prompt_rows)
            elif layer.qkv is not None:
                q, k, v = linear(h, layer.qkv, None, prompt_rows).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
                t = h.shape[0]
                o = attn(i, q.reshape(t, c.num_heads, c.head_dim), k.reshape(t, c.num_kv_heads, c.head_dim),
                         v.reshape(t, c.num_kv_heads, c.head_dim))
                y = linear(o.to(self.dtype), layer.o_proj, None, prompt_rows)  # type: ignore[arg-type]
            elif layer.moe is not None:
                y = layer.moe.forward(h)
            else:
                up = linear(h, layer.up, None, prompt_rows)  # type: ignore[arg-type]
                y = linear(torch.relu(up).square().to(self.dtype), layer.down, None, prompt_rows)  # type: ignore
            h, x = add_rms_norm(y, x, next_norm(self, i), eps, self.dtype)
        return h



def nemotron_moe_config(c: ModelConfig) -> MoEConfig:
    """Nemotron-H's MoE blocks: ungated squared-ReLU experts; the sigmoid router choosing by sigmoid + correction
    bias, the chosen sigmoids renormalized over their sum + 1e-20 (transformers' NemotronHTopkRouter) times the
    routed scaling factor."""
    return MoEConfig(c.num_experts, c.experts_per_token, c.moe_intermediate_size, "sigmoid_bias",
                     c.norm_topk_prob, "relu2", gated=False, scale=c.routed_scaling_factor, norm_eps=1e-20)


def model_class(config: ModelConfig) -> type[NemotronHModel]:
    """Nemotron-H's decoder."""
    return NemotronHModel


def mamba2_dummy_shapes(d: Mamba2Dims, m: str, hidden: int) -> dict[str, tuple[int, ...]]:
    """HF names (under prefix `m`) and shapes of a Mamba-2 mixer's tensors, for random weights."""
    return {m + "in_proj.weight": (d.in_proj_dim, hidden), m + "conv1d.weight": (d.conv_dim, 1, d.conv_kernel),
            m + "conv1d.bias": (d.conv_dim,), m + "dt_bias": (d.num_heads,), m + "A_log": (d.num_heads,),
            m + "D": (d.num_heads,), m + "norm.weight": (d.inner,), m + "out_proj.weight": (hidden, d.inner)}


def dummy_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF names and shapes of a Nemotron-H model's tensors, for random weights (edgeserve.models.dummy)."""
    from edgeserve.models.dummy import attention_shapes, top_shapes

    c, h, d = config, config.hidden_size, mamba2_dims(config)
    shapes = top_shapes(c, "backbone.embeddings.weight", "backbone.norm_f.weight")
    for i in range(c.num_layers):
        m = f"backbone.layers.{i}.mixer."
        shapes[f"backbone.layers.{i}.norm.weight"] = (h,)
        if c.is_linear(i):
            shapes.update(mamba2_dummy_shapes(d, m, h))
        elif c.keeps_kv(i):
            shapes.update(attention_shapes(c, m))
        elif c.is_moe:  # the released MoE models have no plain MLP blocks beside their MoE blocks
            e, f, sh = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
            shapes.update({m + "gate.weight": (e, h), m + "gate.e_score_correction_bias": (e,),
                           m + "experts.up_proj": (e, f, h), m + "experts.down_proj": (e, h, f),
                           m + "shared_experts.up_proj.weight": (sh, h),
                           m + "shared_experts.down_proj.weight": (h, sh)})
        else:
            w = c.intermediate_size
            shapes.update({m + "up_proj.weight": (w, h), m + "down_proj.weight": (h, w)})
    return shapes

