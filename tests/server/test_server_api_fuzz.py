"""Malformed bodies on the embeddings, Anthropic and Responses routes: always a 4xx in the route's error shape,
never a 500, and the server still answers a good request afterwards."""

from __future__ import annotations

import httpx
import pytest

from server_helpers import serve_tiny

BAD_VALUES = [None, 0, -1, 1.5, True, "", "x", [], [None], [[]], [{}], {}, {"type": "text"}, [1, "a"], [[-1]],
              [{"role": "user"}], [{"role": "user", "content": None}], [{"role": "user", "content": [None]}],
              [{"type": "message", "role": "user", "content": [{"type": "input_text"}]}], 10**30]

ROUTES = {
    "/v1/embeddings": ({"model": "tiny", "input": "hi"}, ["model", "input", "encoding_format", "dimensions"]),
    "/api/embed": ({"model": "tiny", "input": "hi"}, ["model", "input", "truncate", "dimensions", "options"]),
    "/api/embeddings": ({"model": "tiny", "prompt": "hi"}, ["model", "prompt", "options", "keep_alive"]),
    "/v1/messages": ({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
                     ["model", "max_tokens", "messages", "system", "temperature", "top_p", "top_k",
                      "stop_sequences", "stream", "thinking", "tools"]),
    "/v1/messages/count_tokens": ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                                  ["model", "messages", "system"]),
    "/v1/responses": ({"model": "tiny", "input": "hi", "max_output_tokens": 2},
                      ["model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream",
                       "text", "tools", "truncation"]),
}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with serve_tiny(tmp_path_factory.mktemp("fuzz")) as s:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            yield c


def _shape_ok(path: str, body) -> bool:
    if path.startswith("/api/"):
        return isinstance(body.get("error"), str)
    if path.startswith("/v1/messages"):
        return body.get("type") == "error" and isinstance(body["error"].get("message"), str)
    return isinstance(body.get("error", {}).get("message"), str)


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_bad_values_never_500(client, path):
    good, fields = ROUTES[path]
    for field in fields:
        for value in BAD_VALUES:
            r = client.post(path, json={**good, field: value})
            assert r.status_code < 500, (field, value, r.text)
            if r.status_code >= 400:
                assert _shape_ok(path, r.json()), (field, value, r.text)
    for raw in (b"", b"[]", b"{", b'"x"'):
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and _shape_ok(path, r.json())
    if not path.startswith(("/v1/embeddings", "/api/embed")):  # tiny is a text model
        assert client.post(path, json=good).status_code == 200
