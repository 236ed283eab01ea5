"""Which model files embed or rerank, and which loader each kind takes: the model manager's one door to them.

GGUF: a BERT-family encoder (`bert`, `nomic-bert`, `jina-bert-v2`; a reranker when its pooling type is rank, or
when it has a classification head and names no pooling), a decoder reranker (pooling type rank: Qwen3-Reranker), or
a decoder whose `<arch>.pooling_type` names a pooling (Qwen3-Embedding, EmbeddingGemma). Hugging Face folder: a
BERT-family encoder (nomic-bert too) or sequence classifier, a sentence-transformers decoder folder
(Qwen3-Embedding, EmbeddingGemma), or a causal LM published as a yes/no reranker (Qwen3-Reranker).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

from edgeserve.memory import load_allocations


def gguf_kind(metadata: Mapping[str, Any], tensor_names: Iterable[str] = ()) -> str | None:
    """What a GGUF serves besides text: "rerank" (pooling type rank, or an encoder with a classification head among
    `tensor_names` and no pooling named), "embedding" (an encoder, or a decoder whose metadata names a pooling), or
    None for a text model."""
    from edgeserve.models.encoders.decoder_embed import gguf_pooling
    from edgeserve.models.encoders.decoder_rerank import is_decoder_reranker
    from edgeserve.models.encoders.gguf_encoder import is_gguf_encoder, is_gguf_reranker

    if is_decoder_reranker(metadata) or is_gguf_reranker(metadata, tensor_names):  # pooling type rank, or a head
        return "rerank"
    return "embedding" if gguf_pooling(metadata) is not None or is_gguf_encoder(metadata) else None


def folder_kind(path: Path) -> str | None:
    """What a Hugging Face folder serves besides text: "rerank" (a sequence classifier, or a causal LM published as
    a yes/no reranker), "embedding" (an encoder or a sentence-transformers decoder), or None."""
    from edgeserve.models.encoders.bert import is_encoder_folder
    from edgeserve.models.encoders.cross_encoder import is_cross_encoder_folder
    from edgeserve.models.encoders.decoder_embed import is_decoder_embed_folder
    from edgeserve.models.encoders.decoder_rerank import is_decoder_rerank_folder

    if is_cross_encoder_folder(path) or is_decoder_rerank_folder(path):
        return "rerank"
    return "embedding" if is_encoder_folder(path) or is_decoder_embed_folder(path) else None


def is_embedding_source(source: Any) -> bool:
    """Whether a resolved model source embeds or reranks (it then loads beside text models, without a KV cache)."""
    if source.kind == "gguf":
        from edgeserve.loaders.gguf_file import GGUFFile

        g = GGUFFile(source.path)
        return gguf_kind(g.metadata, g.tensor_names()) is not None
    return source.kind == "hf" and folder_kind(source.path) is not None


@load_allocations()  # as load_model: the load's temporaries back to the OS, then each forward reuses its buffers' pages
def load_embedding_model(source: Any, device: str = "cpu", dtype: str = "auto", max_len: int | None = None) -> Any:
    """Load an embedding model or reranker (the LoadedEncoder interface); `max_len` caps a decoder's context."""
    from edgeserve.models.encoders.bert import is_encoder_folder, load_encoder
    from edgeserve.models.encoders.cross_encoder import is_cross_encoder_folder, load_cross_encoder
    from edgeserve.models.encoders.decoder_embed import load_decoder_embedder
    from edgeserve.models.encoders.decoder_rerank import (is_decoder_rerank_folder, is_decoder_reranker, load_decoder_reranker,
                                                 load_hf_decoder_reranker)
    from edgeserve.models.encoders.gguf_encoder import is_gguf_encoder, load_gguf_encoder
    from edgeserve.models.encoders.nomic_folder import is_nomic_folder, load_nomic_folder

    if source.kind == "gguf":
        from edgeserve.loaders.gguf_file import GGUFFile

        md = GGUFFile(source.path).metadata
        if is_gguf_encoder(md):
            return load_gguf_encoder(source, device, dtype)
        if is_decoder_reranker(md):
            return load_decoder_reranker(source, device, dtype, max_len)
        return load_decoder_embedder(source, device, dtype, max_len)
    if is_cross_encoder_folder(source.path):
        return load_cross_encoder(source, device, dtype)
    if is_decoder_rerank_folder(source.path):
        return load_hf_decoder_reranker(source, device, dtype, max_len)
    if is_nomic_folder(source.path):
        return load_nomic_folder(source, device, dtype)
    if is_encoder_folder(source.path):
        return load_encoder(source, device, dtype)
    return load_decoder_embedder(source, device, dtype, max_len)  # a sentence-transformers decoder folder
