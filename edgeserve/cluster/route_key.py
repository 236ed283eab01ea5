"""The routing key of a request: chained hashes of its conversation text, cut into fixed chunks.

The ingress routes on the text, not on token ids: it stays model-free (no tokenizer or GGUF read on the ingress
machine, which may not hold the model) and one extraction covers every API shape. The text is the request's model,
system prompt and messages in order, each with its role, so a conversation's next turn extends its previous turn's
text, and requests that share a system prompt share its leading chunks. Chunk i's hash covers chunks 0..i (as the
engine's block hashes chain their parents), so one hash names a whole prefix.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

CHUNK_CHARS = 64  # about 16 tokens of English: one KV block of the engine's default size
MAX_CHUNKS = 2048  # 128k characters; a longer prompt is routed on its first 128k

# generation routes whose JSON bodies carry a conversation (the rest are routed by load alone)
ROUTED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses",
                          "/api/chat", "/api/generate", "/v1/embeddings", "/api/embed", "/api/embeddings"})


def _text(value: Any) -> str:
    """The text of a message's content: a string, a list of parts (their `text`), or a nested `content`."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text(v) for v in value)
    if isinstance(value, dict):
        if isinstance(value.get("text"), str):
            return value["text"]
        if "content" in value:
            return _text(value["content"])
        return json.dumps(value, sort_keys=True)  # tool calls, images: stable, and part of the prefix
    return "" if value is None else str(value)


def conversation_text(body: dict) -> str:
    """The request's model, system prompt and messages (or prompt/input) as one string, in prompt order."""
    parts = [f"model:{body.get('model', '')}\n"]
    for key in ("system", "instructions"):  # Anthropic's system, Responses' instructions
        if body.get(key):
            parts.append(f"system:{_text(body[key])}\n")
    messages = body.get("messages")
    if isinstance(messages, list):
        parts += [f"{m.get('role', '')}:{_text(m.get('content'))}{_text(m.get('tool_calls'))}\n"
                  for m in messages if isinstance(m, dict)]
    for key in ("prompt", "input"):  # completions / generate, Responses / embeddings
        if key in body:
            value = body[key]
            if isinstance(value, list) and all(isinstance(v, dict) for v in value):
                parts += [f"{v.get('role', '')}:{_text(v.get('content', v))}\n" for v in value]
            else:
                parts.append(f"{key}:{_text(value)}\n")
    return "".join(parts)


def chunk_hashes(text: str, chunk_chars: int = CHUNK_CHARS) -> tuple[int, ...]:
    """Chained 64-bit hashes of `text`'s full leading chunks: entry i stands for the prefix of chunks 0..i."""
    out = []
    parent = b""
    data = text.encode("utf-8", "surrogatepass")
    full = min(len(data) // chunk_chars, MAX_CHUNKS)
    for i in range(full):
        digest = hashlib.blake2b(parent + data[i * chunk_chars:(i + 1) * chunk_chars], digest_size=8).digest()
        out.append(int.from_bytes(digest, "little"))
        parent = digest
    return tuple(out)


def route_key(path: str, body: bytes) -> tuple[int, ...]:
    """The prefix hashes a request is routed on; empty for other routes and bodies that are not a JSON object."""
    if path not in ROUTED_PATHS or not body:
        return ()
    try:
        parsed = json.loads(body)
    except ValueError:
        return ()
    return chunk_hashes(conversation_text(parsed)) if isinstance(parsed, dict) else ()
