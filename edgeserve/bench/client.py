"""One streamed completion request against an OpenAI-compatible server, timed chunk by chunk."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import httpx

from edgeserve.bench.workloads import RequestSpec


@dataclass
class RequestResult:
    """What one request measured. Times are seconds from time.perf_counter(); `chunk_times` are the arrival
    times of the SSE chunks that carried generated text."""

    ok: bool
    start: float
    end: float
    chunk_times: list[float] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int | None = None  # from `usage` when the server sent it
    completion_tokens: int | None = None  # from `usage`
    cached_tokens: int | None = None
    # speculative decoding, from `usage.completion_tokens_details` when the server sent it (edgeserve does)
    accepted_drafts: int | None = None
    rejected_drafts: int | None = None
    verifications: int | None = None
    chunks: int = 0  # SSE chunks that carried text
    expected_prompt_tokens: int | None = None
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        """Generated tokens: the server's `usage` count, else the number of text chunks."""
        return self.completion_tokens if self.completion_tokens is not None else self.chunks

    @property
    def token_source(self) -> str:
        """'usage' or 'chunks': where output_tokens came from."""
        return "usage" if self.completion_tokens is not None else "chunks"


@dataclass
class SSEParse:
    """The content of an SSE stream: text per chunk, and usage / error if any event carried them."""

    texts: list[str] = field(default_factory=list)
    usage: dict | None = None
    error: str | None = None
    done: bool = False


def parse_sse_event(data: str, state: SSEParse) -> str | None:
    """Read one `data:` payload into `state`; returns the text it carried (None if none). Handles completion
    chunks (`choices[].text`), chat chunks (`choices[].delta.content`), a usage chunk and an error event."""
    if data == "[DONE]":
        state.done = True
        return None
    try:
        obj = json.loads(data)
    except json.JSONDecodeError:
        state.error = f"bad SSE payload: {data[:80]!r}"
        return None
    if not isinstance(obj, dict):
        return None
    if obj.get("error"):
        err = obj["error"]
        state.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        return None
    if obj.get("usage"):
        state.usage = obj["usage"]
    text = ""
    for choice in obj.get("choices") or []:
        piece = choice.get("text")
        if piece is None:
            piece = (choice.get("delta") or {}).get("content")
        if piece:
            text += piece
    if text:
        state.texts.append(text)
        return text
    return None


def parse_sse_lines(lines: Iterable[str]) -> SSEParse:
    """Parse a whole SSE stream given as lines (for tests and offline use)."""
    state = SSEParse()
    for line in lines:
        if line.startswith("data:"):
            parse_sse_event(line[5:].strip(), state)
    return state


def completion_body(spec: RequestSpec, model: str | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON body of a streamed /v1/completions request for `spec`, asking for usage in the stream."""
    body: dict[str, Any] = {"prompt": spec.prompt, "max_tokens": spec.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": 0.0}
    if model:
        body["model"] = model
    body.update(extra or {})
    return body


async def stream_completion(client: httpx.AsyncClient, url: str, spec: RequestSpec, model: str | None,
                            extra: dict[str, Any] | None = None, timeout: float = 600.0) -> RequestResult:
    """Send `spec` to `url`/v1/completions as a stream and time each text chunk; never raises for server or
    network errors (they come back as ok=False with the message)."""
    body = completion_body(spec, model, extra)
    state = SSEParse()
    times: list[float] = []
    start = time.perf_counter()
    try:
        async with client.stream("POST", url.rstrip("/") + "/v1/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                raw = (await r.aread()).decode(errors="replace")
                try:
                    err = json.loads(raw).get("error")
                    msg = err.get("message") if isinstance(err, dict) else str(err)
                except (json.JSONDecodeError, AttributeError):
                    msg = raw[:200]
                return RequestResult(False, start, time.perf_counter(), error=f"HTTP {r.status_code}: {msg}",
                                     expected_prompt_tokens=spec.prompt_tokens)
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                if parse_sse_event(line[5:].strip(), state) is not None:
                    times.append(time.perf_counter())
                if state.done or state.error:
                    break
    except httpx.HTTPError as e:
        return RequestResult(False, start, time.perf_counter(), chunk_times=times, text="".join(state.texts),
                             error=f"{type(e).__name__}: {e}", expected_prompt_tokens=spec.prompt_tokens)
    end = time.perf_counter()
    usage = state.usage or {}
    details = usage.get("prompt_tokens_details") or {}
    drafts = usage.get("completion_tokens_details") or {}
    error = state.error or (None if times else "no tokens came back")
    return RequestResult(error is None, start, end, chunk_times=times, text="".join(state.texts),
                         prompt_tokens=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens"),
                         cached_tokens=details.get("cached_tokens"),
                         accepted_drafts=drafts.get("accepted_prediction_tokens"),
                         rejected_drafts=drafts.get("rejected_prediction_tokens"),
                         verifications=drafts.get("speculative_verifications"), chunks=len(times),
                         expected_prompt_tokens=spec.prompt_tokens, error=error)
