"""LoRA adapter routes: vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key like every
/v1 route) and llama-server's GET /lora-adapters (the ids a request's `lora` list names)."""

from __future__ import annotations

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from edgeserve.server.adapters import adapter_entries, load_adapter, unload_adapter
from edgeserve.server.body import read_request
from edgeserve.server.fields import reject_unknown
from edgeserve.server.state import api_errors, server_state


@api_errors
async def load_lora(request: Request) -> Response:
    """POST /v1/load_lora_adapter {"lora_name", "lora_path", "base_model"?}: load it now (400 if it does not fit)."""
    body = await read_request(request)
    reject_unknown(body, {"lora_name", "lora_path", "base_model"})
    await load_adapter(server_state(request).manager, body.get("lora_name"), body.get("lora_path"),
                       body.get("base_model"))
    return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")


@api_errors
async def unload_lora(request: Request) -> Response:
    """POST /v1/unload_lora_adapter {"lora_name"}."""
    body = await read_request(request)
    reject_unknown(body, {"lora_name", "lora_int_id"})
    unload_adapter(server_state(request).manager, body.get("lora_name"))
    return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")


@api_errors
async def list_loras(request: Request) -> Response:
    """GET /lora-adapters: [{"id", "path", "scale"}] as llama-server lists them (scale 0: a request picks one)."""
    entries = await anyio.to_thread.run_sync(adapter_entries, server_state(request).manager)
    return JSONResponse([{"id": e["id"], "path": e["path"], "scale": 0.0, "name": e["name"]} for e in entries])


ROUTES = [
    Route("/v1/load_lora_adapter", load_lora, methods=["POST"]),
    Route("/v1/unload_lora_adapter", unload_lora, methods=["POST"]),
    Route("/lora-adapters", list_loras, methods=["GET"]),
]
