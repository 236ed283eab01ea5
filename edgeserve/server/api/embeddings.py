"""Embeddings adapter: OpenAI POST /v1/embeddings, Ollama POST /api/embed and the older POST /api/embeddings.

Each is a thin translation into one `embed()` call: inputs are tokenized (cut to the model's limit when
`truncate` allows, and reported), batched by the model's EmbeddingEngine with other requests, and optionally
shortened to `dimensions` (then re-normalized when the model normalizes).
"""

from __future__ import annotations

import base64
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import anyio.to_thread
import torch
import torch.nn.functional as F
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edgeserve.server.body import read_request
from edgeserve.server.config import UNSET
from edgeserve.server.disconnect import unless_disconnected
from edgeserve.server.errors import APIError, bad_request, model_not_supported
from edgeserve.server.fields import boolean, keep_alive, model_name, positive_integer, reject_unknown
from edgeserve.server.state import api_errors, server_state

log = logging.getLogger("edgeserve.server")

MAX_INPUTS = 2048
OFF_LOOP_CHARS = 32 * 1024  # inputs of at least this many characters are tokenized in a worker thread

T = TypeVar("T")


async def tokenize_off_loop_if_large(fn: Callable[..., T], chars: int, *args: Any) -> T:
    """`fn(*args)`, in a worker thread when the texts it tokenizes are `chars` >= OFF_LOOP_CHARS long: a few short
    texts take tens of microseconds, less than the two thread hand-overs, which a lone request pays in latency."""
    if chars < OFF_LOOP_CHARS:
        return fn(*args)
    return await anyio.to_thread.run_sync(fn, *args)


def text_chars(items: list[Any]) -> int:
    """How many characters the strings among `items` hold (token-id lists count one per id)."""
    return sum(len(x) for x in items)


@dataclass
class EmbedResult:
    """The vectors of one request, with what the client should know about its inputs."""

    model: str
    vectors: torch.Tensor  # [n, dims] float32
    prompt_tokens: int
    truncated: list[int] = field(default_factory=list)  # indices of inputs cut to the model's limit
    load_ns: int = 0
    total_ns: int = 0


def _ids_ok(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                   for i in x)


def parse_inputs(value: Any, name: str) -> list[str | list[int]]:
    """A string, a list of strings, token ids, or a list of token-id lists -> a list of inputs (400 otherwise)."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif _ids_ok(value):
        items = [value]
    elif isinstance(value, list) and value and all(isinstance(x, str) or _ids_ok(x) for x in value):
        items = list(value)
    else:
        raise bad_request(f"{name} is required: a string, a list of strings, a list of token ids or a list of those",
                          name)
    if len(items) > MAX_INPUTS:
        raise bad_request(f"{name} has {len(items)} items; at most {MAX_INPUTS} per request", name)
    for i, x in enumerate(items):
        if isinstance(x, str) and not x:
            raise bad_request(f"{name}[{i}] is an empty string", f"{name}[{i}]")
    return items


def parse_dimensions(body: dict) -> int | None:
    """`dimensions`: a positive integer (a float with no fraction counts), or None."""
    return positive_integer(body, "dimensions")


def _tokenize(lm: Any, inputs: list[str | list[int]], truncate: bool, name: str) -> tuple[list[list[int]], list[int]]:
    limit = lm.config.max_seq_length
    seqs, cut = [], []
    for i, x in enumerate(inputs):
        if isinstance(x, str):
            ids, full = lm.encode(x)
        else:
            bad = [t for t in x if t >= lm.config.vocab_size]
            if bad:
                raise bad_request(f"{name}[{i}]: token id {bad[0]} is out of range (vocabulary size "
                                  f"{lm.config.vocab_size})", f"{name}[{i}]")
            ids, full = x[:limit], len(x)
        if full > len(ids):
            if not truncate:
                raise APIError(400, f"{name}[{i}] has {full} tokens, more than the model's limit of {limit} "
                               "(send truncate: true to cut it)", "invalid_request_error", f"{name}[{i}]",
                               "context_length_exceeded")
            cut.append(i)
        seqs.append(ids)
    return seqs, cut


async def embed(request: Request, model: str, inputs: list[str | list[int]], *, truncate: bool = True,
                dimensions: int | None = None, keep_alive: Any = UNSET, name: str = "input") -> EmbedResult:
    """Embed `inputs` with `model` (loading it if needed); 400 for a model that does not embed."""
    st = server_state(request)
    t0 = time.monotonic()
    lease = await st.manager.acquire(model, keep_alive)
    load_ns = int((time.monotonic() - t0) * 1e9)
    try:
        engine, lm = lease.engine, lease.lm
        if not getattr(engine, "is_embedding", False):
            raise model_not_supported(lease.entry.id, "is not an embedding model: it generates text, and its file "
                                      "names no pooling (a GGUF's <arch>.pooling_type); serve one such as all-minilm")
        if getattr(lm, "is_reranker", False):
            raise model_not_supported(lease.entry.id, "is a reranker: use /v1/rerank")
        hidden = lm.config.hidden_size
        if dimensions is not None and dimensions > hidden:
            raise bad_request(f"dimensions must be at most {hidden} for {lease.entry.id!r}, got {dimensions}",
                              "dimensions")
        seqs, cut = await tokenize_off_loop_if_large(_tokenize, text_chars(inputs), lm, inputs, truncate, name)
        vectors = await unless_disconnected(request, engine.embed(seqs))  # a client that leaves: skipped
        if dimensions is not None and dimensions < hidden:
            vectors = vectors[:, :dimensions]
            if lm.config.normalize:
                vectors = F.normalize(vectors, dim=-1)
        if cut:
            log.info("embeddings: %d of %d inputs cut to %d tokens", len(cut), len(seqs), lm.config.max_seq_length)
        total_ns = int((time.monotonic() - t0) * 1e9)
        num_tokens = sum(len(s) for s in seqs)
        st.metrics.observe_embedding(lease.entry.id, len(seqs), num_tokens, (total_ns - load_ns) / 1e9)
        return EmbedResult(lease.entry.id, vectors, num_tokens, cut, load_ns, total_ns)
    finally:
        lease.release()


_OPENAI_FIELDS = {"model", "input", "encoding_format", "dimensions", "user", "truncate"}


@api_errors
async def openai_embeddings(request: Request) -> Response:
    """POST /v1/embeddings (OpenAI): float or base64 vectors, usage, and `truncated_inputs` (indices cut)."""
    body = await read_request(request)
    reject_unknown(body, _OPENAI_FIELDS, code="unsupported_parameter")
    model = model_name(body)
    fmt = body.get("encoding_format", "float") or "float"
    if fmt not in ("float", "base64"):
        raise bad_request(f"encoding_format must be 'float' or 'base64', got {fmt!r}", "encoding_format")
    inputs = parse_inputs(body.get("input"), "input")
    r = await embed(request, model, inputs, truncate=boolean(body, "truncate", True),
                    dimensions=parse_dimensions(body))
    if fmt == "base64":
        vecs: list[Any] = [base64.b64encode(v.numpy().astype("<f4").tobytes()).decode() for v in r.vectors]
    else:
        vecs = r.vectors.tolist()
    data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vecs)]
    return JSONResponse({"object": "list", "data": data, "model": r.model,
                         "usage": {"prompt_tokens": r.prompt_tokens, "total_tokens": r.prompt_tokens},
                         "truncated_inputs": r.truncated})


def _ollama_options(body: dict) -> None:
    opts = body.get("options")
    if opts is not None and not isinstance(opts, dict):
        raise bad_request("options must be an object", "options")


@api_errors
async def ollama_embed(request: Request) -> Response:
    """POST /api/embed (Ollama): batch `input`, `truncate` (default true), `dimensions`."""
    body = await read_request(request)
    reject_unknown(body, {"model", "input", "truncate", "dimensions", "options", "keep_alive"})
    model = model_name(body, "model is required")
    _ollama_options(body)
    inputs = parse_inputs(body.get("input"), "input")
    r = await embed(request, model, inputs, truncate=boolean(body, "truncate", True),
                    dimensions=parse_dimensions(body), keep_alive=keep_alive(body))
    return JSONResponse({"model": r.model, "embeddings": r.vectors.tolist(), "total_duration": r.total_ns,
                         "load_duration": r.load_ns, "prompt_eval_count": r.prompt_tokens,
                         "truncated_inputs": r.truncated})


@api_errors
async def ollama_embeddings(request: Request) -> Response:
    """POST /api/embeddings (Ollama's older route): one `prompt`, one `embedding`."""
    body = await read_request(request)
    reject_unknown(body, {"model", "prompt", "options", "keep_alive"})
    model = model_name(body, "model is required")
    _ollama_options(body)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request("prompt is required and must be a string", "prompt")
    if not prompt:
        return JSONResponse({"embedding": []})
    r = await embed(request, model, [prompt], keep_alive=keep_alive(body), name="prompt")
    return JSONResponse({"embedding": r.vectors[0].tolist()})


ROUTES = [
    Route("/v1/embeddings", openai_embeddings, methods=["POST"]),
    Route("/api/embed", ollama_embed, methods=["POST"]),
    Route("/api/embeddings", ollama_embeddings, methods=["POST"]),
]
