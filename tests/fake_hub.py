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


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    api = re.compile(r"/api/models/([^/]+/[^/?]+)(?:/revision/[^/?]+)?(?:\?.*)?")
    resolve = re.compile(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _error(self, code: int, error_code: str) -> None:
            body = json.dumps({"error": error_code}).encode()
            self.send_response(code)
            self.send_header("X-Error-Code", error_code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _serve(self) -> None:
            hub.requests.append((self.command, self.path, self.headers.get("Range")))
            m = api.fullmatch(self.path)
            if m and self.command == "GET":
                if m.group(1) not in hub.repos:
                    return self._error(404, "RepoNotFound")
                body = json.dumps(hub.info(m.group(1))).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            m = resolve.fullmatch(self.path)
            if not m or m.group(1) not in hub.repos:
                return self._error(404, "RepoNotFound")
            repo, name = m.group(1), m.group(3)
            data = hub.repos[repo].get(name)
            if data is None:
                return self._error(404, "EntryNotFound")
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
            if (repo, name) in hub.cut_first_get:
                hub.cut_first_get.discard((repo, name))
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(data[start:])

        do_GET = _serve
        do_HEAD = _serve

    return Handler


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
