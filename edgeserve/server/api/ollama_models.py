"""Ollama's model routes: /api/version, tags, ps, show, pull and delete (chat and generate: api/ollama.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, AsyncIterator

import anyio
import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import edgeserve
from edgeserve.errors import UnknownModelError
from edgeserve.registry import CATALOG, is_hf_name, is_pulled, pull, remove, resolve
from edgeserve.registry.resolve import has_gguf_magic
from edgeserve.server.adapters import adapter_entries
from edgeserve.server.api.ollama import now_iso
from edgeserve.server.body import parse_json_object
from edgeserve.server.errors import APIError, bad_request
from edgeserve.server.fields import reject_unknown
from edgeserve.server.model_details import ModelFacts, digest, spec_facts
from edgeserve.server.model_manager import ModelEntry, source_bytes
from edgeserve.server.output_limit import ollama_parameter_lines, output_token_settings
from edgeserve.server.respond import NDJSON
from edgeserve.server.state import api_errors, server_state


async def version(request: Request) -> Response:
    """GET /api/version."""
    return JSONResponse({"version": edgeserve.__version__})


def _details(spec: str, source: Any = None, facts: ModelFacts | None = None) -> dict[str, Any]:
    facts = facts or spec_facts(spec, source)
    if facts is not None:
        return facts.details()
    fmt = "gguf" if spec.endswith(".gguf") or spec in CATALOG else "safetensors"
    return {"parent_model": "", "format": fmt, "family": "", "families": [], "parameter_size": "",
            "quantization_level": ""}


def _digest(spec: str, source: Any) -> str:
    try:
        return digest(source, CATALOG[spec].sha256 if spec in CATALOG else "")
    except OSError:
        return ""


async def tags(request: Request) -> Response:
    """GET /api/tags: every model a request may name, with its size on disk."""
    st = server_state(request)

    def listing() -> list[dict[str, Any]]:
        models = []
        for mid, spec in st.manager.known().items():
            try:
                src = resolve(spec, pull_missing=False)
                if src.kind == "gguf" and not has_gguf_magic(src.path):
                    continue  # a file that cannot load is not listed as a model
                size, mtime, dig = source_bytes(src), src.path.stat().st_mtime, _digest(spec, src)
            except Exception:  # noqa: BLE001 - missing or unusable: not listed
                continue
            facts = spec_facts(spec, src)
            models.append({"name": mid, "model": mid, "modified_at": now_iso(mtime), "size": size,
                           "digest": dig, "details": _details(spec, src, facts),
                           **({"capabilities": facts.capabilities} if facts else {})})
        return models + _adapter_tags(st.manager)

    # headers and hashes read files (a first digest hashes the whole file): off the event loop
    return JSONResponse({"models": await anyio.to_thread.run_sync(listing)})


def _adapter_tags(manager: Any) -> list[dict[str, Any]]:
    """/api/tags entries of the LoRA adapters (by name; `details.parent_model` is the base they run on)."""
    out = []
    for e in adapter_entries(manager):
        mtime = Path(e["path"]).expanduser().stat().st_mtime if Path(e["path"]).expanduser().exists() else None
        out.append({"name": e["name"], "model": e["name"], "modified_at": now_iso(mtime), "size": e["size"],
                    "digest": e["digest"], "details": {"parent_model": e["base"], "format": e["format"],
                                                       "family": "lora", "families": ["lora"],
                                                       "parameter_size": "", "quantization_level": ""}})
    return out


FOREVER_SECONDS = (2 ** 63 - 1) / 1e9


def _ps_entry(e: ModelEntry, state: str, on_gpu: bool, digest_: str, details: dict[str, Any]) -> dict[str, Any]:
    remaining = e.expires_in()
    # forever: as Ollama says it (now plus the longest Go duration, about 292 years), which clients read as "Forever"
    expires = now_iso(time.time() + (FOREVER_SECONDS if remaining is None else remaining))
    out = {"name": e.id, "model": e.id, "size": e.size_bytes, "digest": digest_, "details": details,
           "expires_at": expires, "size_vram": e.size_bytes if on_gpu else 0, "status": state,
           "active_requests": e.active}
    context = getattr(e.engine, "max_model_len", None) if state == "loaded" else None
    if context is not None:
        out["context_length"] = context  # as Ollama reports it: the context the model was loaded with
    stats = e.engine.stats() if state == "loaded" and e.engine is not None else None
    if getattr(stats, "kv_cache_dtype", ""):  # the KV pool: what it stores per value and its size
        out["kv_cache"] = {"dtype": stats.kv_cache_dtype, "bytes": stats.kv_cache_bytes,
                           "blocks": stats.kv_blocks_total, "block_size": stats.kv_block_size}
    if getattr(stats, "state_slots_total", 0):  # a hybrid model's recurrent states beside its KV
        out["recurrent_state"] = {"slots": stats.state_slots_total, "slots_used": stats.state_slots_used,
                                  "snapshots": stats.state_snapshots, "bytes": stats.state_bytes}
    if state == "loading":
        out["loading_seconds"] = round(time.monotonic() - e.load_started, 2)
    elif e.load_seconds is not None:
        out["load_seconds"] = round(e.load_seconds, 3)
    return out


async def ps(request: Request) -> Response:
    """GET /api/ps: loaded and loading models, when each expires, how long loading has taken."""
    st = server_state(request)
    on_gpu = st.config.device.startswith("cuda") or (st.config.device == "auto" and _cuda_available())
    snapshot = [(e, e.state, e.source) for e in st.manager.entries.values()]  # states as of this request
    # file facts (headers, a first digest) are read off the event loop
    facts = await anyio.to_thread.run_sync(lambda: [(_digest(e.spec, src) if src else "", _details(e.spec, src))
                                                    for e, _, src in snapshot])
    return JSONResponse({"models": [_ps_entry(e, state, on_gpu, dig, det)
                                    for (e, state, _), (dig, det) in zip(snapshot, facts)]})


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _model_name(body: dict) -> str:
    """The model an Ollama request names (`model`, or the older `name`); 400 when missing."""
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request("model is required", "model")
    return name


async def _model_request(request: Request, allowed: set[str]) -> tuple[Any, dict, str]:
    """(server state, JSON body with no field outside `allowed`, the model it names) of a model request."""
    body = parse_json_object(await request.body())
    reject_unknown(body, allowed)
    return server_state(request), body, _model_name(body)


@api_errors
async def show(request: Request) -> Response:
    """POST /api/show: what is known about a model (more once it is loaded)."""
    st, _, name = await _model_request(request, {"model", "name", "verbose", "system", "template", "options"})
    mid, spec = st.manager.canonical(name)
    facts = await anyio.to_thread.run_sync(spec_facts, spec)
    if facts is None:
        raise APIError(500, f"cannot read model {mid!r}", "server_error", "model")
    parameters = "\n".join(filter(None, [facts.parameters(), *ollama_parameter_lines(st.config)]))
    caps = facts.capabilities  # a GGUF served with --mmproj takes images too
    if st.config.mmproj_for(spec) and facts.format == "gguf" and "completion" in caps and "vision" not in caps:
        caps = [*caps, "vision"]
    return JSONResponse({"modelfile": f"FROM {spec}\n", "parameters": parameters, "template": facts.template,
                         "details": facts.details(), "model_info": facts.model_info,
                         "capabilities": caps, "license": facts.license,
                         "modified_at": now_iso(), "output_tokens": output_token_settings(st.config)})


class _Lines:
    """A text sink for pull()'s progress lines that forwards each line into a channel from a worker thread."""

    def __init__(self, send: Any) -> None:
        self.send, self.buf = send, ""

    def write(self, s: str) -> int:
        self.buf += s.replace("\r", "\n")
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            if line.strip():
                anyio.from_thread.run(self.send.send, line.strip())
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        raise OSError("not a file")


@api_errors
async def pull_model(request: Request) -> Response:
    """POST /api/pull: download a catalog model, streaming progress as NDJSON (or one reply with stream: false)."""
    st, body, name = await _model_request(request, {"model", "name", "insecure", "stream", "username", "password"})
    name = name[: -len(":latest")] if name.endswith(":latest") else name
    if name not in CATALOG and not is_hf_name(name):
        raise UnknownModelError(f"{name!r} is not in the catalog nor a Hugging Face name (hf.co/OWNER/REPO[:QUANT], "
                                f"OWNER/REPO); catalog models: {', '.join(CATALOG)}")
    if not st.config.allow_pull and not is_pulled(name):
        raise APIError(403, "pulling is disabled on this server", "permission_error", "model")
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise bad_request("stream must be true or false", "stream")
    total = CATALOG[name].size_bytes if name in CATALOG else None

    async def run(send: Any) -> None:
        async with send:
            await anyio.to_thread.run_sync(lambda: pull(name, progress=True, out=_Lines(send)))

    if not stream:
        send, recv = anyio.create_memory_object_stream[str](100)
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, send)
            async with recv:
                async for _ in recv:
                    pass
        return JSONResponse({"status": "success"})

    async def lines() -> AsyncIterator[str]:
        send, recv = anyio.create_memory_object_stream[str](100)
        yield json.dumps({"status": "pulling manifest"}) + "\n"
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, send)
                async with recv:
                    async for line in recv:
                        yield json.dumps({"status": line, **({"total": total} if total else {})}) + "\n"
            yield json.dumps({"status": "success"}) + "\n"
        except Exception as e:
            yield json.dumps({"error": str(e)}) + "\n"

    return StreamingResponse(lines(), media_type=NDJSON)


@api_errors
async def delete_model(request: Request) -> Response:
    """DELETE /api/delete: remove a pulled catalog model from the cache (unloading it first)."""
    st = server_state(request)
    name = _model_name(parse_json_object(await request.body()))
    base = name[: -len(":latest")] if name.endswith(":latest") else name
    if (base not in CATALOG and not is_hf_name(base)) or not is_pulled(base):
        if base in st.manager.configured or base in st.manager.configured.values():
            raise bad_request(f"model {base!r} is a local path given to the server, not a pulled model; "
                              "edgeserve deletes only pulled catalog models", "model")
        raise UnknownModelError(f"model {name!r} is not a pulled catalog model")
    if base in st.manager.entries:
        await st.manager.unload_by_name(base)
        if base in st.manager.entries:
            raise APIError(409, f"model {base!r} is busy with requests; retry when they finish",
                           "invalid_request_error", "model", "model_busy")
    await anyio.to_thread.run_sync(remove, base)
    return JSONResponse({"status": "success"})


ROUTES = [
    Route("/api/version", version, methods=["GET"]),
    Route("/api/tags", tags, methods=["GET"]),
    Route("/api/ps", ps, methods=["GET"]),
    Route("/api/show", show, methods=["POST"]),
    Route("/api/pull", pull_model, methods=["POST"]),
    Route("/api/delete", delete_model, methods=["DELETE"]),
]
