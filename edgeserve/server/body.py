"""Reading a request body: JSON within bounds (depth, number size, valid UTF-8 and Unicode) as an object, parsed
off the event loop when it is large; every failure is a 400 in the route's API shape."""

from __future__ import annotations

import json
import re
from typing import Any, Callable, TypeVar

import anyio.to_thread

from edgeserve.server.errors import APIError, bad_request

T = TypeVar("T")

MAX_JSON_DEPTH = 64  # nesting of objects and lists in a request body
OFF_LOOP_BYTES = 128 * 1024  # a body at least this large is parsed in a worker thread


async def read_request(request: Any, parse: Callable[[dict[str, Any]], T] = lambda body: body) -> T:
    """`parse` of the request's body as a JSON object: a large body (a few MB of JSON, 100k messages: a second of
    Python) is read and checked in a worker thread, so other requests' streams go on meanwhile."""
    body = await request.body()
    if len(body) < OFF_LOOP_BYTES:
        return parse(parse_json_object(body))
    return await anyio.to_thread.run_sync(lambda: parse(parse_json_object(body)))


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
    data = loads_bounded(body)
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", "invalid_request_error", None, "invalid_json")
    return data


def loads_bounded(body: bytes) -> Any:
    """json.loads with the failures a hostile body can cause (too deep, too many digits, bad bytes) as 400s."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise APIError(400, f"request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)",
                       "invalid_request_error", None, "invalid_json") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e}", "invalid_request_error", None,
                       "invalid_json") from None
    except UnicodeDecodeError:
        raise APIError(400, "request body is not valid UTF-8", "invalid_request_error", None, "invalid_json") from None
    except ValueError:  # an integer literal with thousands of digits
        raise APIError(400, "request body holds a number too long to read", "invalid_request_error", None,
                       "invalid_json") from None
    check_json_tree(data)
    return data


# json.loads lets "\ud800" through, and reads raw bytes with surrogatepass: neither is text a tokenizer can take
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_json_tree(data: Any) -> None:
    """400 when `data` nests deeper than MAX_JSON_DEPTH or any key or string holds a lone surrogate (naming the
    field)."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                name = path or "body"
                raise bad_request(f"{name} is not valid Unicode text (it holds a lone surrogate)", path or None)
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise APIError(400, f"request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)",
                           "invalid_request_error", None, "invalid_json")
        if isinstance(node, dict):
            for key, value in node.items():
                child = f"{path}.{key}" if path else key
                if _SURROGATE.search(key):
                    raise bad_request(f"a key in {path or 'the body'} is not valid Unicode text", path or None)
                stack.append((value, child, depth + 1))
        else:
            stack.extend((value, f"{path}[{i}]", depth + 1) for i, value in enumerate(node))


