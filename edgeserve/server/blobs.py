"""Ollama's blob store: files a client pushes by SHA-256 digest (`POST /api/blobs/sha256:<hex>`) before naming them
in `/api/create`, kept under `<edgeserve home>/blobs/` as `sha256-<hex>` (Ollama's own file names)."""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import AsyncIterator

import anyio.to_thread

from edgeserve.server.errors import APIError, bad_request

_DIGEST = re.compile(r"sha256[:-]([0-9a-f]{64})")


def blob_folder() -> Path:
    from edgeserve.registry.paths import edgeserve_home

    return edgeserve_home() / "blobs"


def blob_path(digest: object, field: str = "digest") -> Path:
    """Where the blob of `digest` ("sha256:<64 hex>") lives (whether or not it is there); a 400 naming `field` for a
    malformed digest."""
    m = _DIGEST.fullmatch(digest) if isinstance(digest, str) else None
    if m is None:
        raise bad_request(f"{field} must be a blob digest 'sha256:<64 lowercase hex digits>', got "
                          f"{str(digest)[:80]!r}", field)
    return blob_folder() / f"sha256-{m[1]}"


WRITE_BYTES = 4 * 1024 * 1024  # pushed bytes are hashed and written in pieces of this size, off the event loop


async def save_blob(digest: str, chunks: AsyncIterator[bytes]) -> Path:
    """Stream the pushed bytes to disk as the blob of `digest`; a 400 when they do not hash to it, a 507 when the
    disk is full (nothing is kept then). The body limit is the middleware's (`max_blob_bytes`)."""
    path = blob_path(digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".upload-")

    def write(piece: bytes) -> None:
        h.update(piece)
        f.write(piece)

    try:
        with os.fdopen(fd, "wb") as f:
            pending: list[bytes] = []
            size = 0
            async for chunk in chunks:
                pending.append(chunk)
                size += len(chunk)
                if size >= WRITE_BYTES:
                    await anyio.to_thread.run_sync(write, b"".join(pending))
                    pending, size = [], 0
            await anyio.to_thread.run_sync(write, b"".join(pending))
        if f"sha256-{h.hexdigest()}" != path.name:
            raise bad_request(f"digest {digest} does not match the pushed bytes (sha256:{h.hexdigest()})", "digest")
        os.replace(tmp, path)
    except OSError as e:
        raise APIError(507, f"the blob could not be stored: {e.strerror or e}", "server_error", None,
                       "insufficient_storage") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
