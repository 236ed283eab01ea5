"""Decoder models that embed: a GGUF whose `<arch>.pooling_type` names a pooling (llama.cpp writes it when it
converts an embedding model such as Qwen3-Embedding, gte-Qwen2 or e5-mistral).

The decoder runs over a right-padded batch with causal attention inside each sequence and no KV cache (a padded
position comes after every real one, so causal masking alone keeps it out of their attention); the final hidden
states are pooled (mean, first token or last token, per the metadata) and L2-normalized, as llama.cpp's server
returns them. EmbeddingGemma (`gemma-embedding`: a Gemma 3 body) attends bidirectionally instead (its sliding
layers see keys within half the window on either side, padding masked out) and projects the pooled vector through
its `dense_2` / `dense_3` matrices before normalizing. Sentence-transformers folders of decoders (Qwen3-Embedding,
EmbeddingGemma) load the same way, their pooling and projections from modules.json. The result has the interface
of `bert.LoadedEncoder`, so the engine's EmbeddingEngine batches it like any embedding model.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from edgeserve.models.encoders.bert import pad_batch, pool

log = logging.getLogger(__name__)

# llama.cpp's LLAMA_POOLING_TYPE values that give one vector per input (0 is none: token states; 4 is rank:
# reranker scores, not embeddings)
POOLING_TYPES = {1: "mean", 2: "cls", 3: "lasttoken"}


def gguf_pooling(metadata: Mapping[str, Any]) -> str | None:
    """The pooling a GGUF's metadata names ("mean", "cls", "lasttoken"), or None when it is not an embedding
    model."""
    arch = metadata.get("general.architecture")
    value = metadata.get(f"{arch}.pooling_type")
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return POOLING_TYPES.get(value)


BIDIRECTIONAL_ARCHS = ("gemma-embedding",)  # decoder bodies that embed with bidirectional attention
DENSE_TENSORS = ("dense_2.weight", "dense_3.weight")  # llama.cpp's names of EmbeddingGemma's projections, in order


def gguf_dense(path: Any, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The projections a GGUF applies after pooling (float32 [out, in] each, in order; none for most models)."""
    from edgeserve.loaders.gguf_file import GGUFFile

    g = GGUFFile(path)
    names = set(g.tensor_names())
    return tuple(g.load_tensor(n, torch.float32).to(device) for n in DENSE_TENSORS if n in names)


@dataclass
class DecoderEmbedConfig:
    """What the embedding routes and EmbeddingEngine read of an embedding model's config."""

    vocab_size: int
    hidden_size: int
    max_seq_length: int
    pooling: str
    normalize: bool = True


class PaddedCausalAttention:
    """The decoder's attention over a flat [batch * length] layout of right-padded sequences: each sequence attends
    causally to itself (with the model's sliding window, softcap, scale and sinks); nothing is cached."""

    def __init__(self, batch: int, length: int) -> None:
        self.batch, self.length = batch, length

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
                 softcap: float | None = None, scale: float | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        from edgeserve.kernels.torch.paged_attention import _attention

        b, t = self.batch, self.length
        qh, kh, vh = (x.reshape(b, t, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        mask = None  # causal
        if window is not None:
            pos = torch.arange(t, device=q.device)
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
        out = _attention(qh, kh, vh, mask, scale, q.shape[1] != k.shape[1], softcap, sinks)
        return out.transpose(1, 2).reshape(b * t, -1)


class PaddedBidirectionalAttention(PaddedCausalAttention):
    """Like PaddedCausalAttention, but each token attends to every real token of its sequence (a sliding layer: to
    those at most window / 2 positions away, as llama.cpp's symmetric window and transformers' EmbeddingGemma)."""

    def __init__(self, batch: int, length: int, mask: torch.Tensor) -> None:
        super().__init__(batch, length)
        self.key_mask = mask.bool()[:, None, None, :]  # [b, 1, 1, t]: real tokens

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
                 softcap: float | None = None, scale: float | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        from edgeserve.kernels.torch.paged_attention import _attention

        b, t = self.batch, self.length
        qh, kh, vh = (x.reshape(b, t, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        mask = self.key_mask.to(q.device)
        if window is not None:
            pos = torch.arange(t, device=q.device)
            mask = mask & ((pos[None, :] - pos[:, None]).abs() <= window // 2)
        out = _attention(qh, kh, vh, mask, scale, q.shape[1] != k.shape[1], softcap, sinks)
        return out.transpose(1, 2).reshape(b * t, -1)


@dataclass
class LoadedDecoderEmbedder:
    """A decoder GGUF ready to embed: the model, its tokenizer and its pooling (the LoadedEncoder interface)."""

    name: str
    source: Any
    config: DecoderEmbedConfig
    model: Any  # a decoder from edgeserve.models.decoders
    tokenizer: Any  # edgeserve.loaders.tokenizer.Tokenizer
    eos_id: int | None  # appended to each input when the GGUF asks for it (tokenizer.ggml.add_eos_token)
    device: torch.device
    load_seconds: float
    bidirectional: bool = False
    dense: tuple[torch.Tensor, ...] = ()  # projections applied to the pooled vector, in order (EmbeddingGemma)

    def encode(self, text: str) -> tuple[list[int], int]:
        """(token ids cut to the model's limit, the end token kept; the untruncated token count)."""
        ids = self.tokenizer.encode(text, add_special_tokens=True)
        if self.eos_id is not None:
            ids.append(self.eos_id)
        full, limit = len(ids), self.config.max_seq_length
        if full > limit:
            ids = ids[: limit - 1] + [ids[-1] if self.eos_id is not None else ids[limit - 1]]
        return ids, full

    @torch.inference_mode()
    def embed(self, batch: list[list[int]]) -> torch.Tensor:
        """[len(batch), hidden] float32 embeddings of token-id sequences (each within max_seq_length)."""
        input_ids, mask = pad_batch(batch)
        t = input_ids.shape[1]
        positions = torch.arange(t).repeat(len(batch))
        attn = PaddedBidirectionalAttention(len(batch), t, mask) if self.bidirectional else \
            PaddedCausalAttention(len(batch), t)
        hidden = self.model.forward(input_ids.flatten().to(self.device), positions.to(self.device), attn)
        states = hidden.view(len(batch), t, -1).float()
        out = pool(states, mask.to(self.device), self.config.pooling, normalize=False)
        for w in self.dense:
            out = out @ w.T
        return (F.normalize(out, dim=-1) if self.config.normalize else out).cpu()


def is_decoder_embed_folder(path: Path) -> bool:
    """Whether a Hugging Face folder is a decoder published for sentence-transformers (a modules.json with a Pooling
    module, and not a BERT-family encoder): Qwen3-Embedding, EmbeddingGemma."""
    from edgeserve.models.encoders.bert import is_encoder_folder
    from edgeserve.models.encoders.st_modules import has_pooling

    return path.is_dir() and has_pooling(path) and not is_encoder_folder(path)


def _trailing_special(tokenizer: Any) -> int | None:
    """The id tokenizer.json's post-processor appends to every text (Qwen3-Embedding's <|endoftext|>), or None: the
    embedder appends it (the Tokenizer adds only BOS)."""
    with_specials = tokenizer.backend.encode("a", add_special_tokens=True).ids
    plain = tokenizer.backend.encode("a", add_special_tokens=False).ids
    return with_specials[-1] if with_specials and plain and with_specials[-1] != plain[-1] else None


def load_hf_decoder_embedder(source: Any, device: str = "cpu", dtype: str = "auto",
                             max_len: int | None = None) -> LoadedDecoderEmbedder:
    """Load a sentence-transformers decoder folder (see is_decoder_embed_folder); `max_len` caps its context."""
    from edgeserve.models.load import load_model
    from edgeserve.models.encoders.st_modules import sentence_head

    start = time.monotonic()
    folder = Path(source.path)
    head = sentence_head(folder)
    cfg_json = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    lm = load_model(source, dtype=dtype, device=device, dense_prefill="off")
    c = lm.config
    limit = min(c.max_position_embeddings, max_len) if max_len else c.max_position_embeddings
    dense = tuple(w.to(lm.model.device) for w in head.dense)
    cfg = DecoderEmbedConfig(c.vocab_size, dense[-1].shape[0] if dense else c.hidden_size, limit, head.pooling,
                             head.normalize)
    out = LoadedDecoderEmbedder(lm.name or folder.name, source, cfg, lm.model, lm.tokenizer,
                                _trailing_special(lm.tokenizer), lm.model.device, 0.0,
                                bidirectional=bool(cfg_json.get("use_bidirectional_attention")), dense=dense)
    out.load_seconds = time.monotonic() - start
    log.info("loaded decoder folder %s for embeddings: %d dims, pooling %s%s, max %d tokens, in %.2fs", out.name,
             cfg.hidden_size, head.pooling, " + normalize" if head.normalize else "", limit, out.load_seconds)
    return out


def load_decoder_embedder(source: Any, device: str = "cpu", dtype: str = "auto",
                          max_len: int | None = None) -> LoadedDecoderEmbedder:
    """Load a decoder GGUF that names a pooling (see gguf_pooling), or a sentence-transformers decoder folder, for
    embedding; `max_len` caps its context."""
    from edgeserve.errors import UnsupportedModelError
    from edgeserve.loaders.gguf_file import GGUFFile
    from edgeserve.models.load import load_model

    if source.kind != "gguf":
        return load_hf_decoder_embedder(source, device, dtype, max_len)
    start = time.monotonic()
    metadata = GGUFFile(source.path).metadata
    pooling = gguf_pooling(metadata)
    if pooling is None:
        raise UnsupportedModelError(f"{source.path} names no pooling ({metadata.get('general.architecture')}"
                                    ".pooling_type): it is not an embedding model")
    lm = load_model(source, dtype=dtype, device=device, dense_prefill="off")
    c = lm.config
    limit = min(c.max_position_embeddings, max_len) if max_len else c.max_position_embeddings
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token")) and lm.tokenizer.eos_id is not None
    dense = gguf_dense(source.path, lm.model.device)
    cfg = DecoderEmbedConfig(c.vocab_size, dense[-1].shape[0] if dense else c.hidden_size, limit, pooling)
    out = LoadedDecoderEmbedder(lm.name or source.path.stem, source, cfg, lm.model, lm.tokenizer,
                                lm.tokenizer.eos_id if add_eos else None, lm.model.device, 0.0,
                                bidirectional=metadata.get("general.architecture") in BIDIRECTIONAL_ARCHS,
                                dense=dense)
    out.load_seconds = time.monotonic() - start
    log.info("loaded decoder %s for embeddings: %d dims, pooling %s + normalize, max %d tokens, in %.2fs", out.name,
             cfg.hidden_size, pooling, limit, out.load_seconds)
    return out
