"""ServerConfig: everything `edgeserve serve` can be told, as one frozen dataclass."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from edgeserve.registry import DEFAULT_MODEL

UNSET: Any = type("Unset", (), {"__repr__": lambda self: "UNSET"})()  # "not given" (None means forever)
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
MAX_KEEP_ALIVE = 365 * 24 * 3600.0  # one year; longer is a 400 (a negative value keeps a model loaded forever)


def parse_keep_alive(value: object, name: str = "keep_alive") -> float | None:
    """Read a keep-alive as Ollama does: seconds (number) or a duration string ("5m", "30s", "1h", "-1").

    Returns seconds; None means forever (a negative value). Raises ValueError naming `name`.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a duration like '5m' or a number of seconds, got {str(value)[:40]!r}")
    if isinstance(value, (int, float)):
        seconds = float(value) if abs(value) < 1e300 else float("inf") * (1 if value > 0 else -1)
    elif isinstance(value, str):
        parts = re.findall(r"(-?\d+(?:\.\d+)?)(ms|h|m|s)?", value.strip())
        if not parts or "".join(n + (u or "") for n, u in parts) != value.strip().replace(" ", ""):
            raise ValueError(f"{name} must be a duration like '5m', '30s', '1h30m' or a number of seconds, "
                             f"got {str(value)[:40]!r}")
        seconds = sum(float(n) * _UNITS[u or None] for n, u in parts)
    else:
        raise ValueError(f"{name} must be a duration like '5m' or a number of seconds, got {str(value)[:40]!r}")
    if seconds != seconds:  # NaN
        raise ValueError(f"{name} must be a number, got {value!r}")
    if seconds > MAX_KEEP_ALIVE:
        raise ValueError(f"{name} must be at most 8760h (one year), or negative to keep the model loaded forever; "
                         f"got {str(value)[:40]!r}")
    return None if seconds < 0 else seconds


@dataclass(frozen=True)
class ServerConfig:
    """Settings of one server process; invalid values raise ValueError naming the field."""

    host: str = "127.0.0.1"
    port: int = 8000
    models: tuple[str, ...] = (DEFAULT_MODEL,)  # catalog names or paths; the first is the default
    api_key: str | None = None  # when set, every API route but /health needs `Authorization: Bearer KEY`
    keep_alive: float | None = 300.0  # seconds a model stays loaded after its last request; None: forever
    max_loaded_models: int = 1  # loaded at once; the least recently used idle one is unloaded for a new one
    max_queue: int = 256  # waiting requests per model before 429
    max_seqs: int = 32  # sequences batched in one engine step
    max_model_len: int | None = None  # context length cap (None: the model's own)
    max_batched_tokens: int = 512  # tokens in one engine step
    kv_cache_gb: float | None = None  # KV pool size in GiB (None: the engine default share of free memory)
    dtype: str = "auto"
    device: str = "auto"  # auto (CUDA when available, else CPU), cpu, cuda, cuda:N
    load_format: str = "auto"  # "dummy": random weights of a config.json's shape (benchmarking)
    quantize: str | None = None  # "int4": quantize float models at load (edgeserve.models.load.load_model)
    quantize_group_size: int = 128
    quantize_calibration: str | None = None  # text file for activation-aware scaling
    dense_prefill: str = "auto"  # CPU int4: a bf16 copy of each matrix for prompt tokens (load_model)
    max_body_bytes: int = 4 * 1024 * 1024  # request bodies over this get 413
    max_n: int = 16  # the largest `n` a request may ask for
    allow_pull: bool = True  # POST /api/pull may download catalog models
    log_level: str = "info"
    extra_engine: dict = field(default_factory=dict)  # more EngineConfig fields, passed through

    def __post_init__(self) -> None:
        if isinstance(self.models, (list, str)):
            object.__setattr__(self, "models", tuple([self.models] if isinstance(self.models, str) else self.models))
        if not self.models:
            raise ValueError("models must name at least one model")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be between 0 and 65535, got {self.port!r}")
        for name in ("max_loaded_models", "max_queue", "max_seqs", "max_batched_tokens", "max_body_bytes", "max_n"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.keep_alive is not None and not 0 <= self.keep_alive <= MAX_KEEP_ALIVE:
            raise ValueError(f"keep_alive must be from 0 to {MAX_KEEP_ALIVE:.0f} seconds or None (forever), "
                             f"got {self.keep_alive!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer of at least 2, got {self.max_model_len!r}")
        if self.kv_cache_gb is not None and not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb must be positive, got {self.kv_cache_gb!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.dense_prefill not in ("auto", "on", "off"):
            raise ValueError(f"dense_prefill must be auto, on or off, got {self.dense_prefill!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        from edgeserve.loaders.quantize import check_quantize_options

        check_quantize_options(self.quantize, self.quantize_group_size)
