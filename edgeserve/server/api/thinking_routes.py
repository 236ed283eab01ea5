"""Ending a running request's thinking now: POST /v1/requests/{id}/end_thinking (and /v1/responses/{id}/
end_thinking). The id is the request's X-Request-Id (sent by the client, or read from the reply's header) or its
reply's id; the model's closing tag is written at the next step and the answer follows in the same reply."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edgeserve.server.state import api_errors, server_state


@api_errors
async def end_thinking(request: Request) -> Response:
    """Close the thought of every choice of the running request; `ended`: how many were thinking (0: none)."""
    key = request.path_params["request_id"]
    ended = sum(gen.end_thinking() for gen in server_state(request).live.find(key))
    return JSONResponse({"id": key, "object": "thinking.end", "ended": ended})


ROUTES = [Route("/v1/requests/{request_id}/end_thinking", end_thinking, methods=["POST"]),
          Route("/v1/responses/{request_id}/end_thinking", end_thinking, methods=["POST"])]
