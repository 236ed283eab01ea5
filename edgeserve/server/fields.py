"""Field checks every API adapter shares: types, numeric ranges, stop lists, the model name, unknown fields.

A value that fails gets a 400 naming the field (as the client spelled it, e.g. `options.top_k`) and what is
allowed, so nothing out of range ever reaches the engine; the adapter's route answers it in its API's shape
(edgeserve/server/errors.py picks the shape by path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from edgeserve.sampling_params import SamplingParams
from edgeserve.server.config import UNSET, parse_keep_alive
from edgeserve.server.errors import bad_request

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
    # Ollama's runtime options (edgeserve/server/api/ollama.py says which ones change anything)
    "penalty_last_n": Range(-1, INT32_MAX, integer=True),  # repeat_last_n: -1 = the whole context, 0 = off
    "typical_p": Range(0, 1, low_open=True),
    "tfs_z": Range(0, 1e6),
    "mirostat": Range(0, 2, integer=True),
    "mirostat_eta": Range(0, 1e6),
    "mirostat_tau": Range(0, 1e6),
    "num_thread": Range(0, INT32_MAX, integer=True),
    "num_gpu": Range(-1, INT32_MAX, integer=True),
    "main_gpu": Range(0, INT32_MAX, integer=True),
    "num_batch": Range(1, INT32_MAX, integer=True),
    "num_keep": Range(-1, INT32_MAX, integer=True),
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


def reject_unknown(body: dict, allowed: set[str], ignored: set[str] = frozenset(), code: str | None = None,
                   message: str = "unsupported field {name}") -> None:
    """400 naming the first field of `body` in neither `allowed` nor `ignored` (accepted, changing nothing);
    `message` and `code` are the API's wording (`{name}` is the field, quoted)."""
    unknown = sorted(set(body) - allowed - ignored)
    if unknown:
        raise bad_request(message.format(name=_short(unknown[0]), bare=unknown[0][:100]), unknown[0][:100], code)


def number(body: dict, key: str, *, integer: bool = False, where: str = "", range_key: str | None = None) -> Any:
    """body[key] as a number checked against its range (RANGES[range_key or key]); None when absent."""
    value = body.get(key)
    if value is None:
        return None
    name = where + key
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}", name)
    if integer:
        if isinstance(value, float):
            if not value.is_integer():
                raise bad_request(f"{name} must be an integer, got {value!r}", name)
            value = int(value)
    elif not math.isfinite(value):
        raise bad_request(f"{name} must be a finite number, got {value!r}", name)
    check_range(value, name, range_key or key)
    return value


def boolean(body: dict, key: str, default: bool, where: str = "") -> bool:
    """body[key] as true or false (`default` when absent); anything else is a 400."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{where}{key} must be true or false, got {value!r}", where + key)
    return value


def stop_list(value: Any, name: str = "stop") -> list[str]:
    """Stop strings: one non-empty string or a list of them."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise bad_request(f"{name} must be a non-empty string or a list of non-empty strings", name)
    return value


def model_name(body: dict, message: str = "model is required and must be a non-empty string") -> str:
    """The `model` a request names (a non-empty string)."""
    value = body.get("model")
    if not isinstance(value, str) or not value:
        raise bad_request(message, "model")
    return value


def positive(value: int | None, name: str) -> int | None:
    """A token limit: None or a positive integer (400 naming `name` otherwise)."""
    if value is not None and value < 1:
        raise bad_request(f"{name} must be a positive integer, got {value}", name)
    return value


def positive_integer(body: dict, key: str) -> int | None:
    """body[key] as a positive integer (a float with no fraction counts); None when absent; a 400 naming `key`
    for anything else."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_request(f"{key} must be a positive integer, got {value!r}", key)
    return value


def keep_alive(body: dict) -> Any:
    """Ollama's `keep_alive` (a duration, seconds, or negative for forever) in seconds; UNSET when absent."""
    if body.get("keep_alive") is None:
        return UNSET
    try:
        return parse_keep_alive(body["keep_alive"])
    except ValueError as e:
        raise bad_request(str(e), "keep_alive") from None
