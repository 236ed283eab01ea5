"""Qwen3.5's multi-token-prediction (MTP) head: one extra decoder block that predicts the token after next.

At position i it reads the token x_{i+1} and the trunk's final-normed hidden state h_i (or, while drafting further,
its own previous output g in place of h) and computes

    x = eh_proj([enorm(embed(x_{i+1})) | hnorm(h_i)])          (embedding first, then hidden: llama.cpp's order)
    x = x + o_proj(attention(input_norm(x)))                    (gated full attention, its own K/V cache)
    x = x + ffn(post_norm(x))                                   (a gated MLP, or the MoE layer in `qwen35moe`)
    g = shared_head_norm(x);  logits = lm_head(g)               (the model's lm head unless the head has its own)

The block's attention and feed-forward are shaped as the trunk's full-attention layers and run through the trunk's
own code (`Qwen35Model._attention`, `.mlp`) with the head's K/V at layer 0 of a pool of its own.

Where the weights are: llama.cpp's converter appends the block after the trunk as `blk.{n_layer}` with
`nextn.{eh_proj, enorm, hnorm, shared_head_norm[, shared_head_head, embed_tokens]}` (norms stored as 1 + w); an HF
checkpoint keeps it as `mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.norm` and
`mtp.layers.0.*` (norms stored as w). Both are read here under the converter's intermediate names
`model.layers.{n_layer}.{eh_proj, enorm, hnorm, shared_head.norm, ...}`. Only the first MTP block is used (the
Qwen3.5 / 3.6 checkpoints carry one; llama.cpp runs one too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from edgeserve.errors import ModelLoadError
from edgeserve.kernels.cpu.native import BlockTensor, BlockWeight
from edgeserve.kernels.dispatch import add_rms_norm, linear, rms_norm
from edgeserve.kernels.formats.kv_quant import quantize_q8
from edgeserve.kernels.formats.quant_linear import Int8Weight, LinearWeight
from edgeserve.loaders.weights import WeightSource

from .config import ModelConfig
from .archs.gemma4.model import Table, load_table, table_rows
from .archs.qwen35.native_plan import build_mtp_head
from .llama import load_matrix
from .moe import ffn_input_dtype
from .text_part import RenamedWeights

if TYPE_CHECKING:
    from .qwen35 import Qwen35Layer, Qwen35Model

# the converter's names for the head's own tensors -> the HF checkpoint's
_HF_NEXTN = {"eh_proj.weight": "mtp.fc.weight", "enorm.weight": "mtp.pre_fc_norm_embedding.weight",
             "hnorm.weight": "mtp.pre_fc_norm_hidden.weight", "shared_head.norm.weight": "mtp.norm.weight",
             "shared_head.head.weight": "mtp.shared_head.head.weight", "embed_tokens.weight": "mtp.embed_tokens.weight"}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


class MtpNames(RenamedWeights):
    """The MTP block of an HF checkpoint (`mtp.*`) under the converter's layer-indexed names
    (`model.layers.{trunk + j}.*`); a GGUF's names pass through (its reader maps them)."""

    def __init__(self, source: WeightSource, trunk_layers: int):
        super().__init__(source)
        self.trunk = trunk_layers
        self.hf = getattr(source, "gguf", None) is None

    def _name(self, name: str) -> str:
        m = _LAYER_RE.fullmatch(name)
        if not self.hf or m is None or int(m.group(1)) < self.trunk:
            return name
        j, rest = int(m.group(1)) - self.trunk, m.group(2)
        if rest in _HF_NEXTN and j == 0:
            return _HF_NEXTN[rest]
        return f"mtp.layers.{j}.{rest}"

    def blocks(self, name: str) -> Any:
        blocks = getattr(self.source, "blocks", None)
        return None if blocks is None else blocks(self._name(name))

    def __getattr__(self, name: str) -> Any:  # gguf, stored_quantized, ... of the source
        return getattr(self.source, name)


@dataclass
class MtpHead:
    """The MTP block's weights (norms with the model's offset applied) and the pool config of its K/V."""

    layer: "Qwen35Layer"  # gated full attention + feed-forward, as a trunk layer
    eh_proj: LinearWeight  # [hidden, 2 * hidden]
    enorm: torch.Tensor
    hnorm: torch.Tensor
    head_norm: torch.Tensor
    embed: Table | None  # its own embedding table (None: the model's)
    lm_head: LinearWeight | None  # its own output head (None: the model's)
    kv_config: ModelConfig  # one full-attention layer, for the head's KVPool
    # draft vocabularies cut from the output head, by size (draft_vocab), made on first use
    draft_vocabs: dict[int, "DraftVocab | None"] = field(default_factory=dict, repr=False)
    # the block on the fused native stack (head_decoder: a NativeDecoder, None where it does not fit), planned on first use
    native: Any = field(default=False, repr=False)


def load_mtp_head(model: "Qwen35Model", source: WeightSource, keep_int4: bool = True,
                  dense_prefill: bool = False) -> MtpHead:
    """The first MTP block of `source` (a Qwen3.5 GGUF or HF checkpoint, already wrapped as Qwen35Weights) for
    `model`; raises ModelLoadError when the config has none or a tensor is missing."""
    # the trunk's own classes, from the model (qwen35 imports this module: no import back)
    Qwen35Layer, Qwen35Model = type(model.layers[0]), type(model)
    c, dev, dtype = model.config, model.device, model.dtype
    if not c.mtp_layers:
        raise ModelLoadError(f"this {c.architecture} model has no MTP block")
    src = MtpNames(source, c.num_layers)
    n = c.num_layers
    p = f"model.layers.{n}."

    def norm(name: str) -> torch.Tensor:
        value = src.get(name, keep_int4=False)
        assert isinstance(value, torch.Tensor)
        return value.to(device=dev, dtype=torch.float32).reshape(-1) + c.norm_offset

    def matrix(names: list[str]) -> LinearWeight:
        return load_matrix(src, names, dtype, dev, keep_int4, dense_prefill)

    for name in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "self_attn.q_proj.weight"):
        if not src.has(p + name):
            raise ModelLoadError(f"the MTP block has no {name.rsplit('.', 1)[0]} tensor")
    ffn = Qwen35Model._feed_forward(c, src, n, matrix, dev, dtype)
    a = p + "self_attn."
    layer = Qwen35Layer(input_norm=norm(p + "input_layernorm.weight"),
                        post_norm=norm(p + "post_attention_layernorm.weight"), **ffn,
                        qkv=matrix([a + f"{x}_proj.weight" for x in "qkv"]),
                        q_norm=norm(a + "q_norm.weight"), k_norm=norm(a + "k_norm.weight"),
                        o_proj=matrix([a + "o_proj.weight"]))
    head_norm = norm(p + "shared_head.norm.weight") if src.has(p + "shared_head.norm.weight") else model.norm
    return MtpHead(
        layer=layer, eh_proj=matrix([p + "eh_proj.weight"]), enorm=norm(p + "enorm.weight"),
        hnorm=norm(p + "hnorm.weight"), head_norm=head_norm,
        embed=load_table(src, p + "embed_tokens.weight", dtype, dev) if src.has(p + "embed_tokens.weight") else None,
        lm_head=matrix([p + "shared_head.head.weight"]) if src.has(p + "shared_head.head.weight") else None,
        kv_config=replace(c, num_layers=1, linear_layers=(False,), mtp_layers=0))


def attach_mtp_head(model: "Qwen35Model", source: WeightSource, keep_int4: bool = True,
                    dense_prefill: bool = False) -> None:
    """Set `model.mtp` to its MTP head when the config has one (`model.mtp_error` says why not where it cannot
    be read: the trunk still runs, speculation with `mtp` then refuses with that reason)."""
    model.mtp, model.mtp_error = None, None
    if not model.config.mtp_layers:
        return
    try:
        model.mtp = load_mtp_head(model, source, keep_int4, dense_prefill)
    except ModelLoadError as e:
        model.mtp_error = str(e)


@torch.inference_mode()
def mtp_forward(model: "Qwen35Model", head: MtpHead, token_ids: torch.Tensor, hidden: torch.Tensor,
                positions: torch.Tensor, attn) -> torch.Tensor:
    """The head's normed output g [T, hidden] for rows (token x_{i+1}, hidden h_i) at positions i, over `attn` (a
    KVAttention over the head's own one-layer pool: its layer 0). `lm_logits(g)` are the next-next token's logits;
    g is also the hidden the head reads for the draft after it."""
    eps = model.config.rms_norm_eps
    e = model.embed_rows(token_ids) if head.embed is None else table_rows(head.embed, token_ids)
    x = torch.cat([rms_norm(e, head.enorm, eps), rms_norm(hidden.float(), head.hnorm, eps)], dim=-1)
    x = linear(model.matmul_input(x), head.eh_proj).float()
    native = head_decoder(model, head)
    if native is not None and native.runs(attn):
        return native.forward(x, positions, attn)
    cos, sin = model.cos[positions], model.sin[positions]
    h = rms_norm(x, head.layer.input_norm, eps).to(model.act_dtype)  # as the trunk's
    y = model._attention(0, head.layer, h, cos, sin, attn, None)
    h, x = add_rms_norm(y, x, head.layer.post_norm, eps, ffn_input_dtype(head.layer, model.act_dtype))
    y = model.mlp(head.layer, h, None)  # type: ignore[arg-type]
    g, _ = add_rms_norm(y, x, head.head_norm, eps, model.act_dtype)
    return g


def head_decoder(model: "Qwen35Model", head: MtpHead):
    """The head's block as a one-layer fused native plan (models.archs.qwen35.native_plan.build_mtp_head, planned
    once), where the trunk runs on the fused stack; None: the per-op path (also while the trunk's plan is off)."""
    if model.native_decoder() is None:
        return None
    if head.native is False:
        head.native = build_mtp_head(model, head)
    return head.native


def mtp_logits(model: "Qwen35Model", head: MtpHead, g: torch.Tensor) -> torch.Tensor:
    """Float32 logits [T, vocab] of the head's output rows g."""
    if head.lm_head is None:
        return model.logits(g)
    return linear(g, head.lm_head).float()


# rows of the output head dequantized at a time while a draft vocabulary is cut (keeps the float copy small)
_CUT_ROWS = 8192


@dataclass
class DraftVocab:
    """The output head cut to the token ids `ids` [n] (the lowest n ids: a BPE vocabulary numbers its tokens in merge
    order, so the first ones are the bytes and the earliest, most frequent merges): the head drafts within them, and
    verification stays over the whole vocabulary, so the outputs do not change (only how often drafts are right)."""

    ids: torch.Tensor  # [n] long, the full-vocabulary id of each row of `matrix`
    matrix: LinearWeight  # [n, hidden]
    logit_scale: float


def draft_vocab(model: "Qwen35Model", head: MtpHead, size: int) -> DraftVocab | None:
    """The head's output matrix cut to the lowest `size` token ids (made once per size, kept on the head); None where
    `size` is 0 or covers the vocabulary, or the matrix is of a kind that cannot be cut (the full head drafts)."""
    if size <= 0 or size >= model.config.vocab_size:
        return None
    if size not in head.draft_vocabs:
        head.draft_vocabs[size] = cut_vocab(model, head, torch.arange(size, device=model.device))
    return head.draft_vocabs[size]


def cut_vocab(model: "Qwen35Model", head: MtpHead, ids: torch.Tensor) -> DraftVocab | None:
    """The head's output matrix cut to the token ids `ids` (any order); None where it cannot be cut."""
    matrix = weight_rows(model.lm_head if head.lm_head is None else head.lm_head, ids, model.dtype)
    return None if matrix is None else DraftVocab(ids, matrix, model.config.logit_scale)


def weight_rows(weight: LinearWeight, ids: torch.Tensor, dtype: torch.dtype) -> LinearWeight | None:
    """Rows `ids` of an output matrix as a matrix of their own: GGUF blocks (one part) as q8_0 blocks for the
    native kernels (any block format's rows, dequantized, then q8_0: within a rounding of the stored values), int8
    rows as int8 rows, a dense matrix as its rows; None for any other kind."""
    if isinstance(weight, torch.Tensor):
        return weight[ids].contiguous()
    if isinstance(weight, Int8Weight):
        return Int8Weight(weight.rows(ids), dtype)
    if isinstance(weight, BlockWeight) and len(weight.parts) == 1 and weight.in_features % 32 == 0:
        data = torch.cat([quantize_q8(weight.rows(ids[i: i + _CUT_ROWS])) for i in range(0, len(ids), _CUT_ROWS)])
        return BlockWeight([BlockTensor("Q8_0", data, weight.in_features)], weight.lib)
    return None


def draft_logits(vocab: DraftVocab, g: torch.Tensor) -> torch.Tensor:
    """Float32 logits [T, n] of the head's output rows g over the draft vocabulary (column j: token vocab.ids[j])."""
    logits = linear(g, vocab.matrix).float()
    return logits if vocab.logit_scale == 1.0 else logits / vocab.logit_scale


def full_logits(vocab: DraftVocab, logits: torch.Tensor, size: int) -> torch.Tensor:
    """Draft-vocabulary logits [T, n] spread over the whole vocabulary of `size` ids, -inf outside it (a sampler's
    distribution then gives those tokens q = 0, which rejection sampling takes as it is)."""
    out = logits.new_full((logits.shape[0], size), float("-inf"))
    return out.index_copy_(1, vocab.ids, logits)
