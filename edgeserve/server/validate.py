"""Checks every route shares at the API edge: numeric ranges, JSON nesting depth, valid Unicode, field types.

A value that fails gets a 400 naming the field (as the client spelled it, e.g. `options.top_k`) and what is
allowed, so nothing out of range ever reaches the engine.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from edgeserve.sampling_params import SamplingParams
from edgeserve.server.errors import APIError, bad_request

MAX_JSON_DEPTH = 64  # nesting of objects and lists in a request body
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Range:
    """The values a numeric field accepts: low..high (low itself excluded when `low_open`)."""

    low: float
    high: float
    integer: bool = False
    low_open: bool = False

    def contains(self, value: float) -> bool:
        """Whether `value` is allowed."""
        return (self.low < value if self.low_open else self.low <= value) and value <= self.high

    def describe(self) -> str:
        """The range in words, for error messages and the README."""
        kind = "an integer" if self.integer else "a number"
        low = "above" if self.low_open else "from"
        return f"{kind} {low} {_fmt(self.low)} to {_fmt(self.high)}"


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# Every numeric request field, by its SamplingParams / request name (routes map their own names onto these).
RANGES: dict[str, Range] = {
    "temperature": Range(0, 100),
    "top_p": Range(0, 1, low_open=True),
    "top_k": Range(0, SamplingParams.MAX_TOP_K, integer=True),  # 0 = off
    "min_p": Range(0, 1),
    "presence_penalty": Range(-2, 2),
    "frequency_penalty": Range(-2, 2),
    "repetition_penalty": Range(0, 100, low_open=True),
    "seed": Range(SamplingParams.MIN_SEED, SamplingParams.MAX_SEED, integer=True),
    "max_tokens": Range(1, INT32_MAX, integer=True),
    "max_completion_tokens": Range(1, INT32_MAX, integer=True),
    "max_output_tokens": Range(1, INT32_MAX, integer=True),  # /v1/responses
    "num_predict": Range(-2, INT32_MAX, integer=True),  # Ollama: -1 (or -2) is to the end of the context
    "logprobs": Range(0, SamplingParams.MAX_LOGPROBS, integer=True),
    "top_logprobs": Range(0, SamplingParams.MAX_LOGPROBS, integer=True),
    "best_of": Range(1, INT32_MAX, integer=True),
    "n": Range(1, INT32_MAX, integer=True),  # the server's --max-n narrows it further
}


def check_range(value: int | float, name: str, key: str) -> None:
    """400 naming `name` when `value` is outside RANGES[key] (keys without a range pass)."""
    rng = RANGES.get(key)
    if rng is not None and not rng.contains(value):
        raise bad_request(f"{name} must be {rng.describe()}, got {_short(value)}", name)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:20] + "..." + text[-8:]


def expect_type(body: dict, key: str, types: type | tuple[type, ...], what: str, where: str = "") -> Any:
    """body[key] when absent/None or of `types` (bool never counts as a number); else a 400 saying `what` it must be."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, types) and not (isinstance(value, bool) and bool not in _as_tuple(types)):
        return value
    raise bad_request(f"{where}{key} must be {what}, got {type(value).__name__} {_short(value)}", where + key)


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


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
    """400 when `data` nests deeper than MAX_JSON_DEPTH or any key or string holds a lone surrogate (names the field)."""
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


def reject_unknown(body: dict, allowed: set[str]) -> None:
    """400 naming the first field of `body` that is not in `allowed`."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad_request(f"unsupported field {_short(unknown[0])}", unknown[0][:100])
