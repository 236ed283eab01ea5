"""Ollama-compatible routes: /api/version, tags, ps, show, chat, generate (NDJSON streaming), pull."""

from __future__ import annotations

import datetime as dt
import json
import time
from typing import Any, AsyncIterator

import anyio
import anyio.to_thread
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import edgeserve
from edgeserve.errors import UnknownModelError
from edgeserve.registry import CATALOG, is_pulled, pull, resolve
from edgeserve.server.errors import APIError, bad_request, from_exception
from edgeserve.server.generation import Generation
from edgeserve.server.model_manager import ModelEntry, source_bytes
from edgeserve.server.schemas import (GenerationRequest, parse_json_object, parse_ollama_chat,
                                      parse_ollama_generate)
from edgeserve.server.state import api_errors, server_state

NDJSON = "application/x-ndjson"


def _now_iso(t: float | None = None) -> str:
    return dt.datetime.fromtimestamp(time.time() if t is None else t, dt.timezone.utc).isoformat()


async def version(request: Request) -> Response:
    """GET /api/version."""
    return JSONResponse({"version": edgeserve.__version__})


def _details(name: str) -> dict[str, Any]:
    fmt = "gguf" if name.endswith(".gguf") or name in CATALOG else "safetensors"
    return {"format": fmt, "family": "llama", "families": ["llama"], "parameter_size": "", "quantization_level": ""}


async def tags(request: Request) -> Response:
    """GET /api/tags: every model a request may name, with its size on disk."""
    st = server_state(request)
    models = []
    for mid, spec in st.manager.known().items():
        try:
            src = resolve(spec, pull_missing=False)
            size, mtime = source_bytes(src), src.path.stat().st_mtime
        except Exception:
            size, mtime = 0, time.time()
        models.append({"name": mid, "model": mid, "modified_at": _now_iso(mtime), "size": size,
                       "digest": "", "details": _details(spec)})
    return JSONResponse({"models": models})


def _ps_entry(e: ModelEntry, on_gpu: bool) -> dict[str, Any]:
    remaining = e.expires_in()
    expires = "0001-01-01T00:00:00Z" if remaining is None else _now_iso(time.time() + remaining)
    out = {"name": e.id, "model": e.id, "size": e.size_bytes, "digest": "", "details": _details(e.spec),
           "expires_at": expires, "size_vram": e.size_bytes if on_gpu else 0, "status": e.state,
           "active_requests": e.active}
    if e.state == "loading":
        out["loading_seconds"] = round(time.monotonic() - e.load_started, 2)
    elif e.load_seconds is not None:
        out["load_seconds"] = round(e.load_seconds, 3)
    return out


async def ps(request: Request) -> Response:
    """GET /api/ps: loaded and loading models, when each expires, how long loading has taken."""
    st = server_state(request)
    on_gpu = st.config.device.startswith("cuda") or (st.config.device == "auto" and _cuda_available())
    return JSONResponse({"models": [_ps_entry(e, on_gpu) for e in list(st.manager.entries.values())]})


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _model_name(body: dict) -> str:
    """The model an Ollama request names (`model`, or the older `name`); 400 when missing."""
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request("model is required", "model")
    return name


@api_errors
async def show(request: Request) -> Response:
    """POST /api/show: what is known about a model (more once it is loaded)."""
    st = server_state(request)
    body = parse_json_object(await request.body())
    name = _model_name(body)
    mid, spec = st.manager.canonical(name)
    info: dict[str, Any] = {}
    template = ""
    entry = st.manager.entries.get(mid)
    if entry is not None and entry.lm is not None:
        c = entry.lm.config
        info = {f"general.{k}": v for k, v in vars(c).items() if isinstance(v, (int, float, str, bool))}
        template = getattr(entry.lm.chat_template, "source", "")
    return JSONResponse({"modelfile": "", "parameters": "", "template": template, "details": _details(spec),
                         "model_info": info, "license": CATALOG[spec].license if spec in CATALOG else ""})


async def _load_or_unload(request: Request, req: GenerationRequest, kind: str) -> Response:
    st = server_state(request)
    if req.keep_alive == 0:
        await st.manager.unload_by_name(req.model)
        reason = "unload"
    else:
        lease = await st.manager.acquire(req.model, req.keep_alive)
        lease.release()
        reason = "load"
    mid, _ = st.manager.canonical(req.model)
    body: dict[str, Any] = {"model": mid, "created_at": _now_iso(), "done": True, "done_reason": reason}
    if kind == "chat":
        body["message"] = {"role": "assistant", "content": ""}
    else:
        body["response"] = ""
    return JSONResponse(body)


async def _generate(request: Request, req: GenerationRequest, kind: str) -> Response:
    st = server_state(request)
    if (kind == "chat" and not req.messages) or (kind == "generate" and req.messages == [] and not req.prompts):
        return await _load_or_unload(request, req, kind)
    t0 = time.monotonic()
    lease = await st.manager.acquire(req.model, req.keep_alive)
    load_ns = int((time.monotonic() - t0) * 1e9)
    gen = Generation(lease, req, st.metrics, request.state.request_id, "messages" if kind == "chat" else "prompt")
    gen.constraint_param = "format"
    await gen.prepare()
    gen.submit()

    def piece(text: str, thinking: str = "", calls: list | None = None) -> dict[str, Any]:
        if kind == "chat":
            return {"message": ollama_message(text, thinking, calls)}
        return {"response": text, **({"thinking": thinking} if thinking else {})}

    def final(finish: str | None, n_prompt: int, n_out: int, first: float | None) -> dict[str, Any]:
        end = time.monotonic()
        first = first or end
        return {"model": gen.model, "created_at": _now_iso(), **piece(""), "done": True,
                "done_reason": "stop" if finish in (None, "tool_calls") else finish,  # Ollama: calls end with stop
                "total_duration": int((end - t0) * 1e9), "load_duration": load_ns,
                "prompt_eval_count": n_prompt, "prompt_eval_duration": int((first - gen.t0) * 1e9),
                "eval_count": n_out, "eval_duration": int((end - first) * 1e9)}

    if not req.stream:
        results = await gen.collect_unless_disconnected(request)
        if results is None:
            return Response(status_code=499)  # the client is gone; nothing is sent
        r = results[0]
        out = final(r.finish_reason, r.num_prompt_tokens, r.num_output_tokens, None)
        out.update(piece(r.text, r.reasoning, r.tool_calls))
        return JSONResponse(out)

    async def lines() -> AsyncIterator[str]:
        first = None
        try:
            async for _, out in gen.outputs():
                if out.token_ids and first is None:
                    first = time.monotonic()
                if out.text or out.reasoning or out.tool_calls:
                    yield json.dumps({"model": gen.model, "created_at": _now_iso(),
                                      **piece(out.text, out.reasoning, out.tool_calls), "done": False},
                                     ensure_ascii=False) + "\n"
                if out.finish_reason is not None:
                    yield json.dumps(final(out.finish_reason, out.num_prompt_tokens, out.num_output_tokens,
                                           first)) + "\n"
        except Exception as e:
            yield json.dumps({"error": from_exception(e, gen.request_id).message}) + "\n"
        finally:
            gen.close()

    # close() also runs if the body is never iterated (the client left before the response started)
    return StreamingResponse(lines(), media_type=NDJSON, background=BackgroundTask(gen.aclose))


def ollama_message(content: str, thinking: str = "", calls: list | None = None) -> dict[str, Any]:
    """An Ollama assistant message: content, `thinking` and `tool_calls` (arguments as objects) when present."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        msg["thinking"] = thinking
    if calls:
        msg["tool_calls"] = [c.ollama() for c in calls]
    return msg


@api_errors
async def chat(request: Request) -> Response:
    """POST /api/chat (NDJSON stream by default)."""
    return await _generate(request, parse_ollama_chat(parse_json_object(await request.body())), "chat")


@api_errors
async def generate(request: Request) -> Response:
    """POST /api/generate (NDJSON stream by default; raw: true skips the chat template)."""
    return await _generate(request, parse_ollama_generate(parse_json_object(await request.body())), "generate")


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
    st = server_state(request)
    body = parse_json_object(await request.body())
    name = _model_name(body)
    name = name[: -len(":latest")] if name.endswith(":latest") else name
    if name not in CATALOG:
        raise UnknownModelError(f"{name!r} is not in the catalog; catalog models: {', '.join(CATALOG)}")
    if not st.config.allow_pull and not is_pulled(name):
        raise APIError(403, "pulling is disabled on this server", "permission_error", "model")
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise bad_request("stream must be true or false", "stream")
    entry = CATALOG[name]

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
                        yield json.dumps({"status": line, "total": entry.size_bytes}) + "\n"
            yield json.dumps({"status": "success"}) + "\n"
        except Exception as e:
            yield json.dumps({"error": str(e)}) + "\n"

    return StreamingResponse(lines(), media_type=NDJSON)


ROUTES = [
    Route("/api/version", version, methods=["GET"]),
    Route("/api/tags", tags, methods=["GET"]),
    Route("/api/ps", ps, methods=["GET"]),
    Route("/api/show", show, methods=["POST"]),
    Route("/api/chat", chat, methods=["POST"]),
    Route("/api/generate", generate, methods=["POST"]),
    Route("/api/pull", pull_model, methods=["POST"]),
]
