"""Rerank adapter: POST /v1/rerank, /v2/rerank, /rerank (Jina / Cohere v1 and v2 shapes, as vLLM serves them), llama-server's
/v1/reranking, /reranking, and vLLM's /v1/score (`text_1` against each `text_2`).

The request names a reranker (a cross-encoder; see models/encoders/cross_encoder.py), a `query` and `documents` (strings or
objects with `text`); each (query, document) pair is tokenized as `[CLS] query [SEP] document [SEP]`, the pairs are
batched by the model's EmbeddingEngine like embeddings, and the answer lists `{index, relevance_score[, document]}`
sorted by score, best first, cut to `top_n`. A one-logit head's score is its sigmoid (as sentence-transformers'
CrossEncoder.predict gives it; llama-server returns the raw logit, which orders documents the same); a two-logit
head's is the softmax probability of label 1. Errors are OpenAI-shaped 400s naming the field; fields other clients
send (Cohere's `rank_fields`, `max_tokens_per_doc`) are ignored rather than refused.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edgeserve.server.api.embeddings import MAX_INPUTS, tokenize_off_loop_if_large
from edgeserve.server.body import read_request
from edgeserve.server.disconnect import unless_disconnected
from edgeserve.server.errors import APIError, bad_request, model_not_supported
from edgeserve.server.fields import boolean, model_name, positive_integer
from edgeserve.server.state import api_errors, server_state


def parse_documents(value: Any) -> list[str]:
    """`documents`: a non-empty list of non-empty strings or {"text": string} objects -> their texts (400 else)."""
    if not isinstance(value, list) or not value:
        raise bad_request("documents is required: a non-empty list of strings or {\"text\": ...} objects", "documents")
    if len(value) > MAX_INPUTS:
        raise bad_request(f"documents has {len(value)} items; at most {MAX_INPUTS} per request", "documents")
    texts = []
    for i, d in enumerate(value):
        text = d.get("text") if isinstance(d, dict) else d
        if not isinstance(text, str):
            raise bad_request(f"documents[{i}] must be a string or an object with a string `text`", f"documents[{i}]")
        if not text:
            raise bad_request(f"documents[{i}] is empty", f"documents[{i}]")
        texts.append(text)
    return texts


def parse_top_n(body: dict, count: int) -> int:
    """`top_n`: a positive integer (at most the number of documents is returned), default all."""
    n = positive_integer(body, "top_n")
    return count if n is None else min(n, count)


def relevance(logits: torch.Tensor) -> torch.Tensor:
    """[n] relevance scores from a head's [n, labels] logits: sigmoid of one logit, else P(label 1)."""
    if logits.shape[1] == 1:
        return torch.sigmoid(logits[:, 0])
    return torch.softmax(logits, dim=-1)[:, 1]


def _pairs(lm: Any, pairs: list[tuple[str, str]], truncate: bool, param: str) -> list[list[int]]:
    limit = lm.config.max_seq_length
    seqs = []
    for i, (query, doc) in enumerate(pairs):
        ids, full = lm.encode_pair(query, doc)
        if full > len(ids) and not truncate:
            raise APIError(400, f"{param}[{i}] with its query is {full} tokens, more than the model's limit of "
                           f"{limit} (send truncate: true to cut it)", "invalid_request_error", f"{param}[{i}]",
                           "context_length_exceeded")
        seqs.append(ids)
    return seqs


async def score_pairs(request: Request, model: str, pairs: list[tuple[str, str]], truncate: bool,
                      param: str) -> tuple[str, list[float], int]:
    """(model id, relevance of each (query, document) pair, tokens read) with reranker `model` (loaded if needed);
    400 for a model that does not rerank, or (without `truncate`) a pair past its limit, naming `param`[i]."""
    st = server_state(request)
    t0 = time.monotonic()
    lease = await st.manager.acquire(model)
    try:
        lm, engine = lease.lm, lease.engine
        if not getattr(lm, "is_reranker", False):
            raise model_not_supported(lease.entry.id, "is not a reranker: serve a cross-encoder (a GGUF with pooling "
                                      "type rank, or a *ForSequenceClassification folder) such as bge-reranker")
        chars = sum(len(q) + len(d) for q, d in pairs)
        seqs = await tokenize_off_loop_if_large(_pairs, chars, lm, pairs, truncate, param)
        scores = relevance(await unless_disconnected(request, engine.embed(seqs))).tolist()
        num_tokens = sum(len(s) for s in seqs)
        st.metrics.observe_embedding(lease.entry.id, len(seqs), num_tokens, time.monotonic() - t0)
        return lease.entry.id, scores, num_tokens
    finally:
        lease.release()


@api_errors
async def rerank(request: Request) -> Response:
    """POST /v1/rerank (also /v2/rerank, /rerank, /v1/reranking, /reranking): documents ordered by relevance to the
    query."""
    body = await read_request(request)
    model = model_name(body)
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise bad_request("query is required and must be a non-empty string", "query")
    documents = parse_documents(body.get("documents"))
    top_n = parse_top_n(body, len(documents))
    return_documents = boolean(body, "return_documents", False)
    model_id, scores, num_tokens = await score_pairs(request, model, [(query, d) for d in documents],
                                                     boolean(body, "truncate", True), "documents")
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n]
    results = [{"index": i, "relevance_score": scores[i], **({"document": {"text": documents[i]}}
                                                             if return_documents else {})} for i in order]
    return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "object": "list", "model": model_id,
                         "results": results, "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
                         "meta": {"api_version": {"version": "2" if request.url.path == "/v2/rerank" else "1"},
                                  "billed_units": {"search_units": 1},
                                  "tokens": {"input_tokens": num_tokens, "output_tokens": 0}}})


def _texts(value: Any, name: str) -> list[str]:
    """`text_1` / `text_2` of /v1/score: a non-empty string or a non-empty list of them."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or len(items) > MAX_INPUTS:
        raise bad_request(f"{name} is required: a string or a list of 1 to {MAX_INPUTS} strings", name)
    for i, t in enumerate(items):
        if not isinstance(t, str) or not t:
            raise bad_request(f"{name}[{i}] must be a non-empty string", f"{name}[{i}]")
    return items


@api_errors
async def score(request: Request) -> Response:
    """POST /v1/score (vLLM): the relevance of `text_1` to each `text_2` (one to many, or pairwise lists)."""
    body = await read_request(request)
    model = model_name(body)
    left, right = _texts(body.get("text_1"), "text_1"), _texts(body.get("text_2"), "text_2")
    if len(left) == 1:
        left = left * len(right)
    elif len(left) != len(right):
        raise bad_request(f"text_1 has {len(left)} items and text_2 {len(right)}: give one text_1, or as many as "
                          "text_2", "text_1")
    model_id, scores, num_tokens = await score_pairs(request, model, list(zip(left, right)),
                                                     boolean(body, "truncate", True), "text_2")
    return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": model_id,
                         "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


ROUTES = [*(Route(path, rerank, methods=["POST"]) for path in ("/v1/rerank", "/v2/rerank", "/rerank", "/v1/reranking",
                                                               "/reranking")),
          Route("/v1/score", score, methods=["POST"])]
