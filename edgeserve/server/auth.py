"""API-key check: with a key set, every API route but /health needs `Authorization: Bearer KEY`."""

from __future__ import annotations

import hmac

OPEN_PATHS = ("/health",)  # never need a key
PUBLIC_PREFIXES = ("/static/",)  # the chat page's own files


def needs_key(path: str) -> bool:
    """True for the routes a key protects: everything under /v1 and /api, and /metrics."""
    if path in OPEN_PATHS or path == "/" or path.startswith(PUBLIC_PREFIXES):
        return False
    return True


def authorized(headers: dict[str, str], api_key: str) -> bool:
    """Whether the request's bearer token (or x-api-key) equals `api_key` (constant-time comparison)."""
    auth = headers.get("authorization", "")
    token = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
    return bool(token) and hmac.compare_digest(token.encode(), api_key.encode())
