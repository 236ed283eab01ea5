"""The whole decoder stack in one native call (kernels/cpu/src/layer.c) for a flat batch on the CPU.

`NativeDecoder` holds a plan (the layers' blocks as kernels.cpu.blocks structs) and runs a step with one ctypes
call; `NativeDecoder.build(model)` is the plan of the Llama-like models (attention with its options, the gated MLP
or a MoE feed-forward), made once when the model's weights all stay in GGUF block formats on the native kernels;
other architectures' plans live in their packages (edgeserve/models/archs/<name>/native_plan.py). The C side calls
the same kernels in the same order as the per-op path of LlamaModel.forward, so its results are identical to that
path's, row for row, whatever the batch (a test holds it to that).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.cpu.blocks import MAX_PARTS, Decoder, Layer, Norms, QWeight, StepPools
from edgeserve.kernels.cpu.decoder_moe import moe_plans
from edgeserve.kernels.cpu.lora import step_struct, takes
from edgeserve.kernels.cpu.native import BlockWeight, _attention_rows, kept_f32_ptr, spans_fit_window

FLOATS = (torch.float32, torch.bfloat16)
_POOLS = (*FLOATS, torch.float16, torch.uint8)  # uint8: a q8_0 KV pool (kernels.formats.kv_quant)
# layer.c's cache format argument (kernels/cpu/include/kv_q8.h: KV_F32, KV_BF16, KV_Q8_0, KV_F16)
_POOL_FORMAT = {torch.float32: 0, torch.bfloat16: 1, torch.uint8: 2, torch.float16: 3}


def qweight(w: BlockWeight) -> QWeight:
    parts = w.kernel_parts()
    out = QWeight()
    out.n_parts = len(parts)
    for i, (fmt, ptr, row_bytes, rows) in enumerate(parts):
        out.fmt[i], out.w[i], out.row_bytes[i], out.rows[i] = fmt, ptr, row_bytes, rows
    return out


def fits(weight, shape: tuple[int, int]) -> bool:
    """Whether a weight runs in the stack: GGUF blocks of at most MAX_PARTS parts, of this [out, in] shape."""
    return isinstance(weight, BlockWeight) and len(weight.kernel_parts()) <= MAX_PARTS and weight.shape == shape


@dataclass
class NativeDecoder:
    """A model's layers as C structs, ready for `qmm_decoder_forward`; keeps alive every tensor they point into."""

    lib: ctypes.CDLL = field(repr=False)
    decoder: Decoder = field(repr=False)
    layers: ctypes.Array = field(repr=False)
    keep: list[torch.Tensor] = field(repr=False)
    hidden: int
    act_dtype: torch.dtype
    windowed: bool = False  # some layers attend over a sliding window (the library must have windows)
    min_window: int = 0  # the smallest of those windows
    _pool_layers: tuple | None = field(default=None, repr=False)  # (the last pool seen, its layer_pool array)
    # a hybrid's linear-attention layers: gives a step's StepPools.recurrent struct (and what it points into) for
    # its `attn` (a plan's callable, e.g. kernels.cpu.recurrent_step.RecurrentStep); None: no such layers
    recurrent: Callable[[object], tuple[ctypes.Structure, list]] | None = field(default=None, repr=False)
    moe: list = field(default_factory=list, repr=False)  # the layers' kernels.cpu.moe_layer.NativeMoE plans

    @classmethod
    def build(cls, model) -> "NativeDecoder | None":
        """The fused plan of a model with the Llama-like layer (models.llama's DecoderLayer: attention with a bias,
        Q/K norms, sandwich norms, windows or sinks; a gated MLP or a MoE feed-forward), or None when some part of
        it does not fit the native stack (a weight not in block formats or with too many parts, a Mixture-of-Experts
        feed-forward that moe_layer.c does not take (kernels.cpu.decoder_moe), attention-logit soft-capping, a head
        size the kernels do not take, float32 compute, or the native kernels off)."""
        c = model.config
        layers = model.layers
        lib = cpu_native.library()
        if lib is None or not layers or model.device.type != "cpu" or model.dtype not in FLOATS:
            return None
        moe = moe_plans(model)  # each layer's MoE feed-forward in moe_layer.c (None: a dense MLP)
        f = None if moe is None else _mlp_width(model, moe)
        if f is None:
            return None
        sinks = getattr(model, "sinks", None)  # per-layer attention sinks, with o_proj biases
        # the models whose per-op path attends over their sliding windows: those with local RoPE tables or sinks
        windows = list(c.layer_windows or ()) if hasattr(model, "cos_local") or sinks is not None else []
        rope = _local_rope(model, windows)
        if rope is None:
            return None
        local, local_sin, local_layers = rope
        keep: list[torch.Tensor] = []
        ptr = functools.partial(kept_f32_ptr, keep)
        sandwich = getattr(model, "post_attn_norms", None)
        array = (Layer * len(layers))()
        for i, layer in enumerate(layers):
            out = array[i]
            a = out.attn
            a.qkv, a.o = qweight(layer.qkv), qweight(layer.o_proj)
            a.qkv_bias, a.q_norm, a.k_norm = ptr(layer.qkv_bias), ptr(layer.q_norm), ptr(layer.k_norm)
            a.window, a.local_rope = (windows[i] if windows else None) or 0, int(local_layers[i] and local is not None)
            if sinks is not None:
                a.sinks, a.o_bias = ptr(sinks[i]), ptr(model.o_biases[i])
            if moe[i] is None:
                out.mlp.gate_up, out.mlp.down = qweight(layer.gate_up), qweight(layer.down)
            else:
                out.moe = moe[i].address()
            nxt = layers[i + 1].input_norm if i + 1 < len(layers) else model.norm
            out.norms = Norms(ptr(sandwich[i]) if sandwich else None, ptr(layer.post_norm),
                              ptr(model.post_ffn_norms[i]) if sandwich else None, ptr(nxt))
        scale = c.query_scale if c.query_scale is not None else c.head_dim ** -0.5
        decoder = Decoder(len(layers), c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, f, c.rms_norm_eps,
                          scale, model.dtype == torch.bfloat16, c.activation == "gelu_tanh",
                          ptr(layers[0].input_norm), ctypes.cast(array, ctypes.POINTER(Layer)), ptr(model.cos),
                          ptr(model.sin), ptr(local), ptr(local_sin))
        sliding = [w for w in windows if w is not None]
        return cls(lib, decoder, array, keep, c.hidden_size, model.dtype, bool(sliding), min(sliding, default=0),
                   moe=[p for p in moe if p is not None])

    def takes_lora(self, step) -> bool:
        """Whether the stack runs this step's LoRA adapters (models.lora_step.StepLora) inside it
        (kernels/cpu/src/lora.c)."""
        return takes(step)

    def runs(self, attn: object) -> bool:
        """Whether a step over this attention can take the fused stack: the engine's paged pool (float32,
        bfloat16, float16 or q8_0, contiguous) with its default scale, and the native kernels still on for this call. Not
        a step whose bidirectional spans reach past a sliding window: the stack windows from each row's length,
        while such a row's window starts from its own position (cpu_native.visible_rows, on the per-op path)."""
        pool = getattr(attn, "pool", None)
        if pool is None or getattr(attn, "scale", None) is not None or not hasattr(attn, "meta"):
            return False
        if self.windowed and not spans_fit_window(attn.meta, self.min_window):
            return False
        tensors = [pool.k, pool.v] + ([pool.window_k, pool.window_v] if _second_pool(pool) else [])
        if any(t.dtype != pool.k.dtype or not t.is_contiguous() for t in tensors) or pool.k.dtype not in _POOLS:
            return False
        from edgeserve.kernels.dispatch import backend

        return backend() == "auto" and cpu_native.available()

    def _layer_pool(self, pool) -> torch.Tensor:
        """Layer i's pool (0 main, 1 window) and index in it, as int32 [layers, 2] (cached per pool)."""
        if self._pool_layers is None or self._pool_layers[0] is not pool:
            slots = getattr(pool, "layer_slot", None) or [(False, i) for i in range(self.decoder.n_layers)]
            slots = [s or (False, 0) for s in slots]  # None: a layer without K/V (a hybrid's linear attention)
            self._pool_layers = (pool, torch.tensor([[int(w), j] for w, j in slots], dtype=torch.int32))
        return self._pool_layers[1]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn, lora=None,
                per_layer: torch.Tensor | None = None) -> torch.Tensor:
        """Run every layer over the step's rows: x [T, hidden] float32 embeddings (its rows become the residual
        stream); returns the final-normed hidden states [T, hidden] in the compute dtype. `lora`: the step's
        adapters (models.lora_step.StepLora), applied beside each base matmul (kernels/cpu/src/lora.c); `per_layer`:
        the per-layer inputs [T, layers, width] (float32), where the plan has them (decoder_t.ple_width)."""
        meta, pool = attn.meta, attn.pool
        t = x.shape[0]
        x = x.to(torch.float32).contiguous()  # the residual stream, updated in place
        h = torch.empty(t, self.hidden, dtype=self.act_dtype)
        seqs, lens = _attention_rows(meta)
        layer_pool = self._layer_pool(pool)
        metas = [meta]
        if getattr(pool, "window", None):  # sliding layers in the window pool: its tables and slots
            metas.append(attn.window_meta())
        elif _second_pool(pool):  # sliding layers apart for their K/V shape (per-layer head sizes): the main block ids
            metas.append(meta)
        keep = [layer_pool]
        step = StepPools()
        step.layer_pool = layer_pool.data_ptr()
        for i, (m, k, v) in enumerate(zip(metas, (pool.k, pool.window_k), (pool.v, pool.window_v))):
            tables = m.block_tables if m.block_tables.dtype == torch.int32 else m.block_tables.int()
            tables = tables.contiguous()
            slots = m.slot_mapping.to(torch.int64).contiguous()
            keep += [tables, slots]
            step.k[i], step.v[i], step.layer_stride[i] = k.data_ptr(), v.data_ptr(), k.stride(0)
            step.tables[i], step.table_stride[i], step.slots[i] = tables.data_ptr(), tables.stride(0), slots.data_ptr()
        if lora is not None:
            lora_struct, lora_keep = step_struct(lora)
            keep += [lora_struct, *lora_keep]
            step.lora = ctypes.addressof(lora_struct)
        if self.decoder.ple_width:
            if per_layer is None:
                raise ValueError("this decoder's layers take per-layer inputs")
            per_layer = per_layer.to(torch.float32).contiguous()
            keep.append(per_layer)
            step.ple = per_layer.data_ptr()
        if self.recurrent is not None:
            states, states_keep = self.recurrent(attn)
            keep += [states, *states_keep]
            step.recurrent = ctypes.addressof(states)
        positions = positions.to(torch.int64).contiguous()
        rc = self.lib.qmm_decoder_forward(
            ctypes.byref(self.decoder), t, positions.data_ptr(), x.data_ptr(), h.data_ptr(),
            _POOL_FORMAT[pool.k.dtype], pool.k.shape[2], seqs.data_ptr(), lens.data_ptr(), ctypes.byref(step))
        if rc != 0:
            raise MemoryError(f"native decoder step of {t} rows could not allocate its scratch memory")
        return h


def _second_pool(pool) -> bool:
    """Whether the pool keeps sliding layers apart (`window_k` / `window_v`): in a window pool, or for their K/V
    head shape (per-layer head sizes)."""
    return bool(getattr(pool, "window", None)) or getattr(pool, "window_k", torch.empty(0)).shape[0] > 0


def _mlp_width(model, moe: list) -> int | None:
    """The dense MLP's intermediate size (0 with none), or None when some weight or option does not fit the stack:
    a weight not in block formats, with too many parts or not of the config's shape, an odd head size, attention
    soft-capping, an activation the MLP block lacks, or a block the stack does not run
    (a residual multiplier, norms after the blocks, a Q/K norm over all heads: the per-op path runs them)."""
    c, layers = model.config, model.layers
    dense = [layer for layer, plan in zip(layers, moe) if plan is None]
    weights = [w for layer in layers for w in (layer.qkv, layer.o_proj)]
    weights += [w for layer in dense for w in (layer.gate_up, layer.down)]
    if not all(isinstance(w, BlockWeight) and len(w.kernel_parts()) <= MAX_PARTS for w in weights):
        return None
    if c.head_dim % 2 or c.attn_softcap is not None or c.activation not in ("silu", "gelu_tanh"):
        return None
    if c.residual_scale != 1.0 or c.post_norms or c.qk_norm_full:
        return None
    f = dense[0].gate_up.out_features // 2 if dense else 0
    expected = {"qkv": (c.q_size + 2 * c.kv_size, c.hidden_size), "o_proj": (c.hidden_size, c.q_size)}
    mlp = {"gate_up": (2 * f, c.hidden_size), "down": (c.hidden_size, f)}
    if any(getattr(layer, name).shape != shape for layer in layers for name, shape in expected.items()) or \
            any(getattr(layer, name).shape != shape for layer in dense for name, shape in mlp.items()):
        return None
    return f


def _local_rope(model, windows: list) -> tuple | None:
    """(the local RoPE tables cos, sin or None, None; which layers rotate by them): the sliding layers' own tables,
    or the identity tables of the layers without RoPE (config.rope_layers); None where a model would need both."""
    local = getattr(model, "cos_local", None)
    local = local if local is not None and local is not model.cos else None
    local_sin = model.sin_local if local is not None else None
    local_layers = [w is not None for w in windows] if windows else [False] * len(model.layers)
    if model.config.rope_layers is not None:  # layers without RoPE rotate by the identity tables, as "local" ones
        if local is not None:
            return None
        return model.cos_nope, model.sin_nope, [not r for r in model.config.rope_layers]
    return local, local_sin, local_layers
