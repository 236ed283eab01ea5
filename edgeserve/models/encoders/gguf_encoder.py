"""BERT-family encoders from GGUF files as llama.cpp writes them: `bert` (all-minilm, mxbai-embed-large,
snowflake-arctic-embed, bge; also rerankers with a `cls` head), `nomic-bert` (nomic-embed-text) and `jina-bert-v2`
(jina-embeddings-v2: ALiBi, GEGLU).

Tensors are renamed from llama.cpp's names (`blk.N.attn_q`, `token_embd_norm`, ...) to the BertEncoder names and
dequantized to the run dtype, except the layers' quantized matrices: on the CPU those stay in their GGUF blocks
and run on the native kernels (kernels/cpu/native.py BlockWeight), as llama.cpp runs them. A layer matrix stored
F16 or BF16 is multiplied in bfloat16 (float32 around it) where the CPU has bfloat16 dot products (avx512_bf16 /
amx_bf16) and the dtype is auto: about half the CPU time of torch's float32 GEMM there (docs/perf-log/2026-11-to-12.md), and
within the 16-bit file's own rounding (exact float32 on request: `--dtype float32`); with AVX-512 BF16 on the
native kernel (kernels/formats/bf16_weight.py Bf16Weight, the native pool's threads), else in torch. The tokenizer comes from
the `tokenizer.ggml.*` keys (WordPiece, see loaders/wordpiece.py). Pooling is the file's `<arch>.pooling_type`
(mean, CLS or last token; rank for a reranker) and, as llama.cpp's server and Ollama return them, embeddings are
L2-normalized.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any, Iterable, Mapping

import torch

from edgeserve.errors import ModelLoadError, UnsupportedModelError
from edgeserve.kernels.formats.bf16_weight import Bf16Weight, bf16_library
from edgeserve.kernels.cpu.native import BlockWeight, cpu_flags, library
from edgeserve.loaders.gguf_weights import gguf_blocks
from edgeserve.models.encoders.bert import BertEncoder, EncoderConfig, LoadedEncoder, encoder_dtype
from edgeserve.models.encoders.decoder_embed import gguf_pooling
from edgeserve.models.encoders.jina_bert import JinaBertEncoder
from edgeserve.models.encoders.nomic_bert import NomicBertEncoder

log = logging.getLogger(__name__)

GGUF_ENCODER_ARCHS = {"bert": BertEncoder, "nomic-bert": NomicBertEncoder, "jina-bert-v2": JinaBertEncoder}
RANK_POOLING = 4  # llama.cpp's LLAMA_POOLING_TYPE_RANK: a classification head scores (query, document) pairs
HEAD_TENSOR = "cls.output.weight"  # a classification head's output projection

_TOP = {"token_embd": "embeddings.word_embeddings", "position_embd": "embeddings.position_embeddings",
        "token_types": "embeddings.token_type_embeddings", "token_embd_norm": "embeddings.LayerNorm",
        "cls": "classifier.dense", "cls.output": "classifier.out_proj"}
_LAYER = {"attn_q": "attention.self.query", "attn_k": "attention.self.key", "attn_v": "attention.self.value",
          "attn_qkv": "attention.qkv", "attn_output": "attention.output.dense",
          "attn_output_norm": "attention.output.LayerNorm", "attn_norm_2": "attention.output.LayerNorm2",
          "attn_q_norm": "attention.self.q_norm", "attn_k_norm": "attention.self.k_norm",
          "ffn_up": "intermediate.dense",
          "ffn_gate": "intermediate.gate", "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm"}
DENSE = ("F32", "F16", "BF16")  # matrices torch multiplies (dequantized to the run dtype)
HALF = ("F16", "BF16")  # 16-bit matrices: multiplied in bfloat16 where bf16_matmuls() says so
BF16_DOT_FLAGS = ("avx512_bf16", "amx_bf16")  # CPU flags under which torch's bfloat16 GEMM beats its float32 one
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def is_gguf_encoder(metadata: Mapping[str, Any]) -> bool:
    """Whether a GGUF's architecture is an encoder this module loads (an embedding model or a reranker)."""
    return metadata.get("general.architecture") in GGUF_ENCODER_ARCHS


def is_gguf_reranker(metadata: Mapping[str, Any], tensor_names: Iterable[str] = ()) -> bool:
    """Whether a GGUF encoder scores pairs: `<arch>.pooling_type` is rank, or the file names no pooling and has a
    classification head (`cls.output.weight` among `tensor_names`): llama.cpp's converter writes no pooling type for
    a sequence classifier without sentence-transformers files (bge-reranker-v2-m3), and llama-server scores it
    under `--reranking`."""
    if not is_gguf_encoder(metadata):
        return False
    pooling = metadata.get(f"{metadata.get('general.architecture')}.pooling_type")
    return pooling == RANK_POOLING or (pooling is None and HEAD_TENSOR in tensor_names)


def encoder_name(gguf_name: str) -> str | None:
    """The BertEncoder weight name of a llama.cpp tensor name (None for tensors an encoder does not use)."""
    stem, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    m = _BLOCK.match(stem)
    if m is not None:
        part = _LAYER.get(m[2])
        return None if part is None else f"encoder.layer.{m[1]}.{part}.{kind}"
    part = _TOP.get(stem)
    return None if part is None else f"{part}.{kind}"


def gguf_encoder_config(metadata: Mapping[str, Any]) -> EncoderConfig:
    """The encoder's shape from `<arch>.*` keys; pooling from `<arch>.pooling_type` (mean when absent)."""
    arch = str(metadata.get("general.architecture"))

    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"GGUF {arch} encoder metadata has no {arch}.{name}")
        return value

    ctx = int(key("context_length"))
    return EncoderConfig(
        vocab_size=len(metadata.get("tokenizer.ggml.tokens") or []), hidden_size=int(key("embedding_length")),
        num_layers=int(key("block_count")), num_heads=int(key("attention.head_count")),
        intermediate_size=int(key("feed_forward_length")), max_position_embeddings=ctx,
        type_vocab_size=int(metadata.get("tokenizer.ggml.token_type_count", 2)),
        layer_norm_eps=float(key("attention.layer_norm_epsilon", 1e-12)),
        hidden_act="silu" if arch == "nomic-bert" else "gelu", pooling=gguf_pooling(metadata) or "mean",
        normalize=True, max_seq_length=ctx, rope_theta=float(key("rope.freq_base", 10000.0)))


def bf16_matmuls(dtype: str, device: torch.device) -> bool:
    """Whether an encoder's F16 / BF16 layer matrices run in bfloat16: dtype auto, on a CPU with bfloat16 dot
    products."""
    return dtype == "auto" and device.type == "cpu" and any(f in cpu_flags() for f in BF16_DOT_FLAGS)


def read_weights(gguf: Any, device: torch.device, dtype: torch.dtype, half_dtype: torch.dtype | None = None
                 ) -> dict[str, Any]:
    """Every tensor an encoder uses, renamed onto `device`: a layer's matrix stored in a block format the native
    CPU kernels take (Q8_0, Q4_K, ...) stays in its blocks as a BlockWeight when those kernels run here; one stored
    F16 / BF16 becomes `half_dtype` when given (bfloat16: a Bf16Weight on the native kernel where this CPU runs it,
    else a torch tensor); the rest (embeddings, norms, biases, F32 matrices, the classifier head) is dequantized to
    `dtype`."""
    weights: dict[str, Any] = {}
    lib = native_library(device)
    bf16_lib = bf16_library(lib) if lib is not None and half_dtype == torch.bfloat16 else None
    for name in gguf.tensor_names():
        target = encoder_name(name)
        if target is None:
            continue
        blocks, load_dtype, half = None, dtype, False
        if target.startswith("encoder.layer.") and target.endswith(".weight"):
            info = gguf.tensor_info(name)
            matrix = len(info.shape) == 2
            blocks = gguf_blocks(gguf, name) if lib is not None and matrix and info.qtype not in DENSE else None
            half = half_dtype is not None and matrix and info.qtype in HALF
            if half:
                load_dtype = half_dtype
        if blocks is not None:
            weights[target] = BlockWeight([blocks], lib)
        elif half and bf16_lib is not None:
            weights[target] = Bf16Weight(gguf.load_tensor(name, torch.bfloat16), bf16_lib)
        else:
            weights[target] = gguf.load_tensor(name, load_dtype).to(device)
    for needed in ("embeddings.word_embeddings.weight", "embeddings.LayerNorm.weight"):
        if needed not in weights:
            raise ModelLoadError(f"{gguf.path}: tensor for {needed!r} missing; not a BERT-family GGUF")
    return weights


def native_library(device: torch.device) -> Any:
    """The native CPU kernel library when an encoder on `device` can use it (CPU, EDGESERVE_NATIVE not 0)."""
    return library() if device.type == "cpu" else None


def with_specials(backend: Any, metadata: Mapping[str, Any]) -> Any:
    """The tokenizer, given the `<s> A </s>` template of the file's add_bos / add_eos / add_sep flags when it has no
    post-processor of its own (a RoBERTa encoder's byte-level BPE, tokenizer model `gpt2`: granite-embedding)."""
    import json

    import tokenizers

    from edgeserve.loaders.unigram import special_template

    if backend.post_processor is not None:
        return backend
    template = special_template(metadata, list(metadata.get("tokenizer.ggml.tokens") or []))
    if template is None:
        return backend
    spec = json.loads(backend.to_str())
    spec["post_processor"] = template
    return tokenizers.Tokenizer.from_str(json.dumps(spec))


def load_gguf_encoder(source: Any, device: str = "cpu", dtype: str = "auto") -> LoadedEncoder:
    """Load a `bert` / `nomic-bert` / `jina-bert-v2` GGUF as an embedding model, or as a reranker when its pooling
    is rank."""
    from edgeserve.device import resolve_device
    from edgeserve.loaders.gguf_file import GGUFFile
    from edgeserve.loaders.tokenizer import tokenizer_from_gguf

    start = time.monotonic()
    gguf = GGUFFile(source.path)
    md = gguf.metadata
    arch = md.get("general.architecture")
    if arch not in GGUF_ENCODER_ARCHS:
        raise UnsupportedModelError(f"{source.path}: architecture {arch!r} is not a supported GGUF encoder "
                                    f"(supported: {', '.join(GGUF_ENCODER_ARCHS)})")
    cfg = gguf_encoder_config(md)
    dev = resolve_device(device)
    half = torch.bfloat16 if bf16_matmuls(dtype, dev) else None
    weights = read_weights(gguf, dev, encoder_dtype(dtype, dev), half)
    tok = tokenizer_from_gguf(md)
    backend = with_specials(tok.backend, md)
    backend.no_padding()
    backend.no_truncation()
    sep = md.get("tokenizer.ggml.seperator_token_id", md.get("tokenizer.ggml.eos_token_id"))
    name = source.path.stem if getattr(source, "name", None) is None else source.name
    args = (name, source, cfg, GGUF_ENCODER_ARCHS[arch](cfg, weights), backend, tok.bos_id,
            None if sep is None else int(sep), dev, 0.0)
    reranker = is_gguf_reranker(md, gguf.tensor_names())
    if reranker:
        from edgeserve.models.encoders.cross_encoder import LoadedCrossEncoder, classifier_head

        lm: LoadedEncoder = LoadedCrossEncoder(*args, head=classifier_head(weights, str(source.path)))
    else:
        lm = LoadedEncoder(*args)
    lm.load_seconds = time.monotonic() - start
    log.info("loaded %s GGUF %s: %d layers, %d dims, %s, max %d tokens, in %.2fs", arch, lm.name, cfg.num_layers,
             cfg.hidden_size, "reranker" if reranker else f"pooling {cfg.pooling} + normalize",
             cfg.max_seq_length, lm.load_seconds)
    return lm
