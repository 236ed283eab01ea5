"""Ollama's /api/create (adapter models: edgeserve/server/adapter_create.py) and the blob routes its clients push
files with first: HEAD and POST /api/blobs/sha256:<hex>."""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edgeserve.server.adapter_create import create_adapter_model
from edgeserve.server.blobs import blob_path, save_blob
from edgeserve.server.body import read_request
from edgeserve.server.errors import bad_request
from edgeserve.server.respond import NDJSON
from edgeserve.server.state import api_errors, server_state


@api_errors
async def create(request: Request) -> Response:
    """POST /api/create {"model", "from", "adapters", "stream"?}: Ollama's status lines (or one object with
    "stream": false); errors are checked before anything streams, so they come back as a 400."""
    body = await read_request(request)
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise bad_request("stream must be true or false", "stream")
    name = await create_adapter_model(server_state(request).manager, body)
    if not stream:
        return JSONResponse({"status": "success"})
    lines = [{"status": "using existing layer"}, {"status": f"creating adapter model {name}"}, {"status": "success"}]
    return StreamingResponse(iter([json.dumps(x) + "\n" for x in lines]), media_type=NDJSON)


@api_errors
async def head_blob(request: Request) -> Response:
    """HEAD /api/blobs/{digest}: 200 when the server has the blob, else 404."""
    return Response(status_code=200 if blob_path(request.path_params["digest"]).is_file() else 404)


@api_errors
async def push_blob(request: Request) -> Response:
    """POST /api/blobs/{digest}: store the body as that blob (a 400 when it does not hash to the digest)."""
    await save_blob(request.path_params["digest"], request.stream())
    return Response(status_code=201)


ROUTES = [
    Route("/api/create", create, methods=["POST"]),
    Route("/api/blobs/{digest}", head_blob, methods=["HEAD"]),
    Route("/api/blobs/{digest}", push_blob, methods=["POST"]),
]
