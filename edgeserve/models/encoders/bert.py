"""BERT-family sentence encoders (embedding models) from a Hugging Face folder.

The folder holds `config.json`, `*.safetensors`, `tokenizer.json` and, for sentence-transformers models,
`modules.json` + `1_Pooling/config.json` (pooling mode, whether a Normalize module follows) and
`sentence_bert_config.json` (`max_seq_length`). The forward pass runs over a padded batch with an attention
mask and no KV cache: an encoder sees each input once.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
import torch.nn.functional as F

from edgeserve.errors import ModelLoadError, UnsupportedModelError
from edgeserve.kernels.formats.bf16_weight import Bf16Weight
from edgeserve.kernels.cpu.native import BlockWeight
from edgeserve.kernels.cpu.encoder_attention import attention_library, encoder_attention
from edgeserve.kernels.cpu.encoder_gelu import bias_gelu_, gelu_library
from edgeserve.kernels.formats.quant_linear import linear
from edgeserve.models.encoder_threads import encoder_threads, intra_op_threads, uses_native_pool

log = logging.getLogger(__name__)

# the layout implemented here: post-LayerNorm, absolute positions (RoBERTa's start after its padding id)
ENCODER_MODEL_TYPES = ("bert", "xlm-roberta", "roberta")
NOMIC_MODEL_TYPE = "nomic_bert"  # a nomic-bert folder: an encoder too, loaded by models/encoders/nomic_folder.py
ROBERTA_TYPES = ("xlm-roberta", "roberta")
POOLING_MODES = ("mean", "cls", "max", "lasttoken")


@dataclass
class EncoderConfig:
    """The shape of a BERT encoder and how its token states become one vector."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    pooling: str = "mean"
    normalize: bool = False
    max_seq_length: int = 512
    rope_theta: float = 10000.0  # rotary encoders (nomic-bert) only


def is_encoder_folder(path: Path) -> bool:
    """Whether a Hugging Face folder (or config.json) holds an encoder this module loads."""
    cfg_path = path / "config.json" if path.is_dir() else path
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and cfg.get("model_type") in (*ENCODER_MODEL_TYPES, NOMIC_MODEL_TYPE)


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None


def encoder_config(folder: Path) -> EncoderConfig:
    """The encoder's config.json plus the sentence-transformers pooling / normalize / max length settings."""
    cfg = _json(folder / "config.json") or {}
    if cfg.get("model_type") not in ENCODER_MODEL_TYPES:
        raise UnsupportedModelError(f"{folder}: model_type {cfg.get('model_type')!r} is not a supported encoder "
                                    f"(supported: {', '.join(ENCODER_MODEL_TYPES)})")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise UnsupportedModelError(f"{folder}: position_embedding_type {cfg['position_embedding_type']!r} "
                                    "is not supported")
    max_pos = int(cfg.get("max_position_embeddings", 512)) - position_offset(cfg)
    pooling, normalize, max_len = sentence_settings(folder, max_pos)
    try:
        return EncoderConfig(
            vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]), num_heads=int(cfg["num_attention_heads"]),
            intermediate_size=int(cfg["intermediate_size"]), max_position_embeddings=max_pos,
            type_vocab_size=int(cfg.get("type_vocab_size", 2)), layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
            hidden_act=str(cfg.get("hidden_act", "gelu")), pooling=pooling, normalize=normalize,
            max_seq_length=max_len)
    except KeyError as e:
        raise ModelLoadError(f"{folder}/config.json is missing {e.args[0]}") from None


def sentence_settings(folder: Path, max_pos: int) -> tuple[str, bool, int]:
    """(pooling, normalize, max length) from a folder's sentence-transformers files (CLS, no normalization and
    `max_pos` for a plain folder, as transformers' pipelines use it)."""
    pooling, normalize = "cls", False
    for m in _json(folder / "modules.json") or []:
        kind = str(m.get("type", ""))
        if kind.endswith("Pooling"):
            pcfg = _json(folder / m.get("path", "1_Pooling") / "config.json") or {}
            pooling = _pooling_mode(pcfg, folder)
        elif kind.endswith("Normalize"):
            normalize = True
    st_cfg = _json(folder / "sentence_bert_config.json") or {}
    return pooling, normalize, min(int(st_cfg.get("max_seq_length") or max_pos), max_pos)


def position_offset(cfg: dict) -> int:
    """How many rows of the position table come before position 0 (RoBERTa's pad_token_id + 1; BERT's none)."""
    return int(cfg.get("pad_token_id", 1)) + 1 if cfg.get("model_type") in ROBERTA_TYPES else 0


def _pooling_mode(pcfg: dict, folder: Path) -> str:
    modes = [name for key, name in (("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"),
                                    ("pooling_mode_max_tokens", "max"), ("pooling_mode_lasttoken", "lasttoken"))
             if pcfg.get(key)]
    if pcfg.get("pooling_mode_mean_sqrt_len_tokens") or pcfg.get("pooling_mode_weightedmean_tokens") or len(modes) > 1:
        raise UnsupportedModelError(f"{folder}: pooling {pcfg} is not supported (one of {', '.join(POOLING_MODES)})")
    return modes[0] if modes else "mean"


_ACTS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu}


class BertEncoder(torch.nn.Module):
    """BERT's embeddings + post-LayerNorm transformer layers; forward gives the last hidden states."""

    fuses_qkv = True  # whether forward reads a fused `attention.self.qkv` (subclasses with their own forward: no)

    def __init__(self, cfg: EncoderConfig, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        if cfg.hidden_act not in _ACTS:
            raise UnsupportedModelError(f"hidden_act {cfg.hidden_act!r} is not supported")
        if self.fuses_qkv:
            fuse_qkv(cfg, weights)
        self.cfg = cfg
        self.w = weights
        self.act = _ACTS[cfg.hidden_act]
        # beside native matmuls, attention and the up projection's GELU on the native pool too (torch's ops run on
        # one thread there)
        native = uses_native_pool(weights)
        self.attn_lib = attention_library(cfg.hidden_size // cfg.num_heads) if native else None
        self.gelu_lib = gelu_library() if native and cfg.hidden_act == "gelu" else None

    def _ln(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.w[f"{name}.weight"], self.w[f"{name}.bias"],
                            self.cfg.layer_norm_eps)

    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w, b = self.w[f"{name}.weight"], self.w.get(f"{name}.bias")
        if isinstance(w, torch.Tensor):
            if w.dtype != x.dtype:  # a 16-bit matrix of a float32 encoder (gguf_encoder.bf16_matmuls)
                y = F.linear(x.to(w.dtype), w).to(x.dtype)
                return y if b is None else y + b
            return F.linear(x, w, b)
        if isinstance(w, Bf16Weight):  # a 16-bit GGUF matrix on the native bfloat16 kernel, the bias added there
            return w.matmul(x, b).to(x.dtype)
        return linear(x, w, b).to(x.dtype)  # a GGUF block weight: the native quantized matmul (float32 out)

    def _token_types(self, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        """The segment embeddings to add: type 0 everywhere, or per token (clamped to the model's type count)."""
        table = self.w.get("embeddings.token_type_embeddings.weight")
        if table is None:
            return torch.zeros((), dtype=self.w["embeddings.word_embeddings.weight"].dtype)
        if token_type_ids is None:
            return table[0]
        return table[token_type_ids.clamp(max=table.shape[0] - 1)]

    def _embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        """The embedding layer's output [batch, seq, hidden]: word (+ learned position, where the model has a table:
        RoPE and ALiBi encoders have none) + segment embeddings, LayerNormed."""
        w = self.w
        x = w["embeddings.word_embeddings.weight"][input_ids]
        positions = w.get("embeddings.position_embeddings.weight")
        if positions is not None:
            x = x + positions[torch.arange(input_ids.shape[1], device=input_ids.device)]
        return self._ln(x + self._token_types(token_type_ids), "embeddings.LayerNorm")

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[batch, seq] ids and 0/1 mask (and segment ids, 0 when None) -> [batch, seq, hidden] states (padding
        positions are garbage)."""
        c = self.cfg
        x = self._embed(input_ids, token_type_ids)
        mask = additive_mask(attention_mask, x.dtype)
        lengths = prefix_lengths(attention_mask) if self.attn_lib is not None else None
        for i in range(c.num_layers):
            p = f"encoder.layer.{i}"
            if f"{p}.attention.self.qkv.weight" in self.w:
                q, k, v = self._lin(x, f"{p}.attention.self.qkv").split(c.hidden_size, dim=-1)
            else:
                q, k, v = (self._lin(x, f"{p}.attention.self.{n}") for n in ("query", "key", "value"))
            a = self._lin(self._attend(q, k, v, mask, lengths), f"{p}.attention.output.dense")
            x = self._ln(a + x, f"{p}.attention.output.LayerNorm")
            h = self._lin(self._up_act(x, f"{p}.intermediate.dense"), f"{p}.output.dense")
            x = self._ln(h + x, f"{p}.output.LayerNorm")
        return x

    def _up_act(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """The activation of the feed-forward up projection `name`: its bias and GELU in one native pass in place
        where that runs (a native matrix, erf GELU), else act(_lin)."""
        w = self.w[f"{name}.weight"]
        if self.gelu_lib is not None and not isinstance(w, torch.Tensor):
            y = w.matmul(x)  # a BlockWeight or Bf16Weight: float32 rows, the bias not yet added
            if bias_gelu_(y, self.w.get(f"{name}.bias"), self.gelu_lib):
                return y.to(x.dtype)
        return self.act(self._lin(x, name))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                lengths: torch.Tensor | None) -> torch.Tensor:
        """Attention of q, k, v [batch, seq, hidden]: the native kernel where it runs (`lengths`: each row's
        unpadded length), else torch's under the additive `mask`."""
        if lengths is not None:
            out = encoder_attention(q, k, v, lengths, self.cfg.num_heads, self.attn_lib)
            if out is not None:
                return out
        b, t, hidden = q.shape
        heads = self.cfg.num_heads
        q, k, v = (y.view(b, t, heads, hidden // heads).transpose(1, 2) for y in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return a.transpose(1, 2).reshape(b, t, hidden)


def fuse_qkv(cfg: EncoderConfig, weights: dict[str, Any]) -> None:
    """Each layer's query, key and value matrices (and biases) replaced by one `attention.self.qkv` where all three
    run on the native kernels (BlockWeight or Bf16Weight): one matmul, activation quantization and pool hand-over
    instead of three; each output value is the same bits as from its own matrix."""
    for i in range(cfg.num_layers):
        p = f"encoder.layer.{i}.attention.self"
        names = [f"{p}.{n}" for n in ("query", "key", "value")]
        ws = [weights.get(f"{n}.weight") for n in names]
        bs = [weights.get(f"{n}.bias") for n in names]
        if any(b is None for b in bs):
            continue
        if all(isinstance(w, BlockWeight) for w in ws) and len({id(w.lib) for w in ws}) == 1:
            fused: Any = BlockWeight([part for w in ws for part in w.parts], ws[0].lib)
        elif all(isinstance(w, Bf16Weight) for w in ws):
            fused = Bf16Weight.stacked(ws)
        else:
            continue
        weights[f"{p}.qkv.weight"], weights[f"{p}.qkv.bias"] = fused, torch.cat(bs)
        for n in names:
            del weights[f"{n}.weight"], weights[f"{n}.bias"]


def prefix_lengths(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """Each row's token count when the 0/1 mask is right padding (ones, then zeros, at least one one), else None."""
    lengths = attention_mask.sum(1)
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    ok = bool((lengths > 0).all()) and torch.equal(attention_mask.bool(), positions < lengths[:, None])
    return lengths if ok else None


def additive_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[batch, 1, 1, seq] attention bias from a 0/1 mask: padded keys get -inf for every query."""
    b, t = attention_mask.shape
    mask = torch.zeros(b, 1, 1, t, dtype=dtype, device=attention_mask.device)
    return mask.masked_fill_(attention_mask[:, None, None, :] == 0, float("-inf"))


def segment_ids(input_ids: torch.Tensor, sep_id: int | None) -> torch.Tensor:
    """BERT's token types for `[CLS] A [SEP] B [SEP]` rows: 1 after the first [SEP], else 0 (all 0 without one)."""
    if sep_id is None:
        return torch.zeros_like(input_ids)
    is_sep = (input_ids == sep_id).long()
    return ((is_sep.cumsum(1) - is_sep) > 0).long()


def encoder_dtype(dtype: str, dev: torch.device) -> torch.dtype:
    """The torch dtype an encoder runs in: as asked, else float32 on the CPU and float16 on accelerators."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        dtype, torch.float32 if dev.type == "cpu" else torch.float16)


def pad_batch(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id sequences as right-padded ids [B, T] (padding 0) and their attention mask [B, T] (1 = token)."""
    t = max(len(ids) for ids in batch)
    input_ids = torch.zeros(len(batch), t, dtype=torch.long)
    mask = torch.zeros(len(batch), t, dtype=torch.long)
    for i, ids in enumerate(batch):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
    return input_ids, mask


def pool(states: torch.Tensor, attention_mask: torch.Tensor, mode: str, normalize: bool) -> torch.Tensor:
    """One vector per sequence from [batch, seq, hidden] states under the 0/1 mask (float32)."""
    m = attention_mask.to(states.dtype).unsqueeze(-1)
    if mode == "mean":
        out = (states * m).sum(1) / m.sum(1).clamp(min=1e-9)
    elif mode == "cls":
        out = states[:, 0]
    elif mode == "max":
        out = states.masked_fill(m == 0, float("-inf")).max(1).values
    else:  # lasttoken: the last unpadded position (right padding)
        last = attention_mask.sum(1) - 1
        out = states[torch.arange(states.shape[0]), last]
    out = out.float()
    return F.normalize(out, dim=-1) if normalize else out


@dataclass
class LoadedEncoder:
    """An embedding model ready to run: the encoder, its tokenizer and its pooling."""

    name: str
    source: Any
    config: EncoderConfig
    model: BertEncoder
    tokenizer: Any  # tokenizers.Tokenizer, padding and truncation off
    cls_id: int | None
    sep_id: int | None
    device: torch.device
    load_seconds: float
    is_encoder: bool = True

    def encode(self, text: str) -> tuple[list[int], int]:
        """(token ids cut to the model's limit with [SEP] kept, the untruncated token count)."""
        ids = self.tokenizer.encode(text, add_special_tokens=True).ids
        full = len(ids)
        limit = self.config.max_seq_length
        if full > limit:
            ids = ids[: limit - 1] + ([self.sep_id] if self.sep_id is not None and ids[-1] == self.sep_id
                                      else [ids[limit - 1]])
        return ids, full

    @cached_property
    def on_native_pool(self) -> bool:
        """Whether the encoder's layer matrices run on the native kernels' thread pool."""
        return uses_native_pool(self.model.w)

    def threads(self, input_ids: torch.Tensor) -> ContextManager[None]:
        """Torch's thread count (encoder_threads) for a forward over the padded batch `input_ids` and the ops on its
        states after it (pooling, a reranker's head): right after the forward the native pool's workers still spin,
        and a 512-token text's mean pooling took 13 ms on two OpenMP threads beside them, 0.1 ms on one."""
        return intra_op_threads(encoder_threads(self.on_native_pool, input_ids.numel()))

    def states(self, input_ids: torch.Tensor, mask: torch.Tensor,
               token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The encoder's last hidden states [batch, seq, hidden] of a padded batch, on the torch thread count
        encoder_threads picks for it."""
        with self.threads(input_ids):
            return self.model(input_ids, mask, token_type_ids)

    def embed(self, batch: list[list[int]]) -> torch.Tensor:
        """[len(batch), hidden] float32 embeddings of token-id sequences (each within max_seq_length)."""
        input_ids, mask = pad_batch(batch)
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        with self.threads(input_ids):
            states = self.states(input_ids, mask)
            return pool(states, mask, self.config.pooling, self.config.normalize).cpu()


def _first_id(tok: Any, *names: str) -> int | None:
    """The id of the first of `names` in the vocabulary (BERT's [CLS] / [SEP], else RoBERTa's <s> / </s>)."""
    return next((i for i in map(tok.token_to_id, names) if i is not None), None)


def read_folder_weights(folder: Path, dev: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's `*.safetensors` on `dev` in `dtype`, BERT's / RoBERTa's model prefix dropped."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                name = key.removeprefix("bert.").removeprefix("roberta.")
                weights[name] = st.get_tensor(key).to(dev, dtype)
    return weights


def read_encoder_folder(source: Any, read_config: Callable[[Path], EncoderConfig], device: str,
                        dtype: str) -> tuple[Path, EncoderConfig, torch.device, dict[str, torch.Tensor]]:
    """(folder, its config by `read_config`, the resolved device, its safetensors weights on that device in the
    encoder dtype) for an encoder folder `source`."""
    from edgeserve.device import resolve_device

    folder = Path(source.path)
    cfg = read_config(folder)
    dev = resolve_device(device)
    return folder, cfg, dev, read_folder_weights(folder, dev, encoder_dtype(dtype, dev))


def folder_encoder(source: Any, cfg: EncoderConfig, model: BertEncoder, dev: torch.device,
                   start: float) -> LoadedEncoder:
    """The LoadedEncoder of a folder's `model`, with the folder's tokenizer.json (padding and truncation off)."""
    import tokenizers

    folder = Path(source.path)
    tok_file = folder / "tokenizer.json"
    if not tok_file.is_file():
        raise ModelLoadError(f"{folder} has no tokenizer.json")
    tok = tokenizers.Tokenizer.from_file(str(tok_file))
    tok.no_padding()
    tok.no_truncation()
    lm = LoadedEncoder(folder.name if source.name is None else source.name, source, cfg, model, tok,
                       _first_id(tok, "[CLS]", "<s>"), _first_id(tok, "[SEP]", "</s>"), dev, 0.0)
    lm.load_seconds = time.monotonic() - start
    log.info("loaded encoder %s: %d layers, %d dims, pooling %s%s, max %d tokens, in %.2fs", lm.name,
             cfg.num_layers, cfg.hidden_size, cfg.pooling, " + normalize" if cfg.normalize else "",
             cfg.max_seq_length, lm.load_seconds)
    return lm


def load_encoder(source: Any, device: str = "cpu", dtype: str = "auto") -> LoadedEncoder:
    """Load a BERT-family sentence encoder from a Hugging Face folder (float32 on the CPU, fp16/bf16 on CUDA)."""
    start = time.monotonic()
    folder, cfg, dev, weights = read_encoder_folder(source, encoder_config, device, dtype)
    offset = position_offset(_json(folder / "config.json") or {})
    if offset and "embeddings.position_embeddings.weight" in weights:  # RoBERTa: position 0 is row pad_token_id + 1
        weights["embeddings.position_embeddings.weight"] = weights["embeddings.position_embeddings.weight"][offset:]
    missing = [n for n in ("embeddings.word_embeddings.weight", "encoder.layer.0.attention.self.query.weight")
               if n not in weights]
    if missing:
        raise ModelLoadError(f"{folder}: weights {missing[0]!r} missing; not a BERT checkpoint")
    return folder_encoder(source, cfg, BertEncoder(cfg, weights), dev, start)
