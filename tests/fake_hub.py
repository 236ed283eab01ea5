"""A local HTTP server with the Hugging Face Hub's URL layout, for huggingface_hub to talk to in tests (HF_ENDPOINT).

Serves `GET /api/models/OWNER/REPO[/revision/REV]` (model info with file sizes, git blob ids and LFS sha256s) and
`HEAD`/`GET /OWNER/REPO/resolve/REV/FILE` (with Range). It can lie about a file's sha256 and cut a file's first
download halfway, and it logs every request.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_SUFFIXES = (".gguf", ".safetensors")


@dataclass
class FakeHub:
    """What the server serves and what it saw."""

    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    wrong_sha256: set[tuple[str, str]] = field(default_factory=set)  # (repo, file) listed with a wrong sha256
    cut_first_get: set[tuple[str, str]] = field(default_factory=set)  # (repo, file) whose first GET stops halfway
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, Range header)
    url: str = ""

    def info(self, repo: str) -> dict:
        siblings = []
        for name, data in sorted(self.repos[repo].items()):
            entry = {"rfilename": name, "size": len(data),
                     "blobId": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
            if name.endswith(LFS_SUFFIXES):
                sha = hashlib.sha256(data).hexdigest()
                if (repo, name) in self.wrong_sha256:
                    sha = hashlib.sha256(b"something else").hexdigest()
                entry["lfs"] = {"sha256": sha, "size": len(data), "pointerSize": 134}
            siblings.append(entry)
        return {"id": repo, "modelId": repo, "sha": COMMIT, "private": False, "siblings": siblings}


_API = re.compile(r"/api/models/([^/]+/[^/?]+)(?:/revision/[^/?]+)?(?:\?.*)?")
_RESOLVE = re.compile(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)")


class _HubHandler(BaseHTTPRequestHandler):
    """Answers as the Hub does for `hub`'s repos (a subclass sets `hub`)."""

    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _error(self, code: int, error_code: str) -> None:
        self._send_json(code, {"error": error_code}, (("X-Error-Code", error_code),))

    def _send_json(self, code: int, obj, headers: tuple[tuple[str, str], ...] = ()) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _serve(self) -> None:
        self.hub.requests.append((self.command, self.path, self.headers.get("Range")))
        m = _API.fullmatch(self.path)
        if m and self.command == "GET":
            if m.group(1) not in self.hub.repos:
                return self._error(404, "RepoNotFound")
            return self._send_json(200, self.hub.info(m.group(1)))
        m = _RESOLVE.fullmatch(self.path)
        if not m or m.group(1) not in self.hub.repos:
            return self._error(404, "RepoNotFound")
        repo, name = m.group(1), m.group(3)
        data = self.hub.repos[repo].get(name)
        if data is None:
            return self._error(404, "EntryNotFound")
        self._send_file(repo, name, data)

    def _send_file(self, repo: str, name: str, data: bytes) -> None:
        etag = hashlib.sha256(data).hexdigest() if name.endswith(LFS_SUFFIXES) else \
            hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        start = 0
        rng = self.headers.get("Range")
        if rng and self.command == "GET":
            start = int(re.match(r"bytes=(\d+)-", rng).group(1))
        self.send_response(206 if start else 200)
        self.send_header("ETag", f'"{etag}"')
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if self.command == "HEAD":
            return
        if (repo, name) in self.hub.cut_first_get:
            self.hub.cut_first_get.discard((repo, name))
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(data[start:])

    do_GET = _serve
    do_HEAD = _serve


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    """A request handler class serving `hub`."""
    return type("Handler", (_HubHandler,), {"hub": hub})


@contextlib.contextmanager
def running(hub: FakeHub) -> Iterator[FakeHub]:
    """Serve `hub` on a free loopback port until the block ends; `hub.url` is its endpoint."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
