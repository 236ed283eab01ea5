"""ServerConfig: everything `edgeserve serve` can be told, as one frozen dataclass."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from edgeserve.engine.config import EngineConfig
from edgeserve.errors import check_field, config_error
from edgeserve.registry import DEFAULT_MODEL

UNSET: Any = type("Unset", (), {"__repr__": lambda self: "UNSET"})()  # "not given" (None means forever)
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
DEFAULT_MAX_TOKENS = 2048  # a reply, not a runaway: a request without a limit would run to the context's end
MAX_KEEP_ALIVE = 365 * 24 * 3600.0  # one year; longer is a 400 (a negative value keeps a model loaded forever)


def parse_keep_alive(value: object) -> float | None:
    """Read a keep-alive as Ollama does: seconds (number) or a duration string ("5m", "30s", "1h", "-1").

    Returns seconds; None means forever (a negative value). Raises ConfigError (a ValueError): the same line for the
    `--keep-alive` flag and a request's `keep_alive` field.
    """
    def bad(requirement: str) -> ValueError:
        return config_error(ServerConfig, "keep_alive", requirement, value if not isinstance(value, str)
                            else value[:40])

    if isinstance(value, bool):
        raise bad("be a duration like '5m' or a number of seconds")
    if isinstance(value, (int, float)):
        if value != value:  # NaN: before any comparison, which would read it as a side of infinity
            raise bad("be a number")
        seconds = float(value) if abs(value) < 1e300 else float("inf") * (1 if value > 0 else -1)
    elif isinstance(value, str):
        # ASCII digits only: float() would read "١" (Arabic-Indic one) as 1
        parts = re.findall(r"(-?[0-9]+(?:\.[0-9]+)?)(ms|h|m|s)?", value.strip())
        if not parts or "".join(n + (u or "") for n, u in parts) != value.strip().replace(" ", ""):
            raise bad("be a duration like '5m', '30s', '1h30m' or a number of seconds")
        seconds = sum(float(n) * _UNITS[u or None] for n, u in parts)
    else:
        raise bad("be a duration like '5m' or a number of seconds")
    if seconds != seconds:  # NaN
        raise bad("be a number")
    if seconds > MAX_KEEP_ALIVE:
        raise bad("be at most 8760h (one year), or negative to keep the model loaded forever")
    return None if seconds < 0 else seconds


def _flag(default, flag: str):
    """A field with a default, settable from the command line as `flag`."""
    return field(default=default, metadata={"flag": flag})


@dataclass(frozen=True)
class ServerConfig:
    """Settings of one server process; invalid values raise ConfigError (a ValueError) naming the field and its flag.

    `engine` is the EngineConfig every model's engine is built from (batch limits, KV pool, offload, speculation):
    the same dataclass the CLI's `run` and the Python API's `LLM` take.
    """

    host: str = _flag("127.0.0.1", "--host")
    port: int = _flag(8000, "--port")
    models: tuple[str, ...] = (DEFAULT_MODEL,)  # catalog names or paths; the first is the default
    api_key: str | None = None  # when set, every API route but /health needs `Authorization: Bearer KEY`
    # seconds a model stays loaded after its last request; None: forever
    keep_alive: float | None = _flag(300.0, "--keep-alive")
    # loaded at once; the least recently used idle one is unloaded for a new one
    max_loaded_models: int = _flag(1, "--max-loaded-models")
    engine: EngineConfig = field(default_factory=EngineConfig)
    dtype: str = _flag("auto", "--dtype")
    device: str = _flag("auto", "--device")  # auto (CUDA when available, else CPU), cpu, cuda, cuda:N
    load_format: str = _flag("auto", "--load-format")  # "dummy": random weights of a config.json's shape
    quantize: str | None = None  # "int4": quantize float models at load (edgeserve.models.load.load_model)
    quantize_group_size: int = 128
    quantize_calibration: str | None = None  # text file for activation-aware scaling
    dense_prefill: str = _flag("auto", "--dense-prefill")  # CPU int4: a bf16 copy of each matrix for prompt tokens
    # the experts of the first N MoE layers (or "all") in host memory on the CPU kernels (edgeserve.models.cpu_moe)
    cpu_moe_layers: int | str | None = _flag(None, "--cpu-moe-layers")
    max_body_bytes: int = 32 * 1024 * 1024  # request bodies over this get 413 (images come base64 in the body)
    # a blob pushed to /api/blobs (an adapter's files) streams to disk up to this many bytes instead
    max_blob_bytes: int = _flag(8 * 1024 ** 3, "--max-blob-bytes")
    # image input (edgeserve/vision): projectors of GGUF models as (model, mmproj file) pairs, each for its model
    # alone (a plain path: for the first model; a model without one finds it beside its file or in its HF folder),
    # whether http(s) image URLs are fetched, and the limits of one request
    mmproj: tuple[tuple[str, str], ...] | str | None = _flag((), "--mmproj")
    allow_image_urls: bool = _flag(False, "--allow-image-urls")
    max_images: int = 8  # images per request
    max_image_pixels: int = 4096 * 4096  # pixels per image
    max_n: int = 16  # the largest `n` a request may ask for
    # output tokens of a request that sets no limit; None: up to the end of the context (server/output_limit.py)
    default_max_tokens: int | None = _flag(DEFAULT_MAX_TOKENS, "--default-max-tokens")
    max_tokens_limit: int | None = _flag(None, "--max-tokens-limit")  # the most output tokens a request gets
    allow_pull: bool = True  # POST /api/pull may download catalog models
    # Responses `background: true` replies kept in memory (server/response_store.py): how many, and for how many
    # seconds a finished one stays readable
    max_stored_responses: int = 64
    stored_response_seconds: float = 3600.0
    # a resumable stream (`stream_options.resumable`) that no client follows is cancelled after this many seconds
    resume_grace_seconds: float = 60.0
    # the reply format (tool calls, reasoning) of every model served, instead of the one detected from its chat
    # template: a name in edgeserve.text.formats (for a model whose template is ambiguous)
    tool_format: str | None = _flag(None, "--tool-format")
    log_level: str = "info"

    def load_config(self):
        """The LoadConfig every model this server loads is loaded with."""
        from edgeserve.models.load_config import LoadConfig

        return LoadConfig(dtype=self.dtype, device=self.device, load_format=self.load_format, quantize=self.quantize,
                          quantize_group_size=self.quantize_group_size,
                          quantize_calibration=self.quantize_calibration, dense_prefill=self.dense_prefill,
                          cpu_moe_layers=self.cpu_moe_layers)

    def __post_init__(self) -> None:
        if isinstance(self.models, (list, str)):
            object.__setattr__(self, "models", tuple([self.models] if isinstance(self.models, str) else self.models))
        if not self.models:
            raise config_error(ServerConfig, "models", "name at least one model", self.models)
        if self.mmproj is None or isinstance(self.mmproj, str):
            object.__setattr__(self, "mmproj", ((self.models[0], self.mmproj),) if self.mmproj else ())
        if not all(isinstance(p, tuple) and len(p) == 2 and p[0] in self.models for p in self.mmproj):
            raise config_error(ServerConfig, "mmproj", "pair each projector with a configured model",
                               self.mmproj)
        if not isinstance(self.engine, EngineConfig):
            raise config_error(ServerConfig, "engine", "be an EngineConfig", self.engine)
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise config_error(ServerConfig, "port", "be between 0 and 65535", self.port)
        for name in ("max_loaded_models", "max_body_bytes", "max_blob_bytes", "max_n", "max_images", "max_image_pixels",
                     "max_stored_responses"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise config_error(ServerConfig, name, "be a positive integer", value)
        for name in ("default_max_tokens", "max_tokens_limit"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise config_error(ServerConfig, name, "be a positive integer or None (off)", value)
        if self.keep_alive is not None and not 0 <= self.keep_alive <= MAX_KEEP_ALIVE:
            raise config_error(ServerConfig, "keep_alive", f"be from 0 to {MAX_KEEP_ALIVE:.0f} seconds or None "
                               "(forever)", self.keep_alive)
        for name in ("stored_response_seconds", "resume_grace_seconds"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise config_error(ServerConfig, name, "be a number of seconds >= 0", value)
        if self.load_format not in ("auto", "dummy"):
            raise config_error(ServerConfig, "load_format", "be auto or dummy", self.load_format)
        if self.dense_prefill not in ("auto", "on", "off"):
            raise config_error(ServerConfig, "dense_prefill", "be auto, on or off", self.dense_prefill)
        from edgeserve.models.cpu_moe import parse_cpu_moe_layers

        check_field(self, "cpu_moe_layers", "be a non-negative integer or 'all'", parse_cpu_moe_layers)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise config_error(ServerConfig, "dtype", "be auto, float32, bfloat16 or float16", self.dtype)
        if self.tool_format is not None:
            from edgeserve.text.formats import all_formats

            known = sorted(f.name for f in all_formats())
            if self.tool_format not in known:
                raise config_error(ServerConfig, "tool_format", f"be one of {', '.join(known)}", self.tool_format)
        from edgeserve.loaders.quantize_options import check_quantize_options

        check_quantize_options(self.quantize, self.quantize_group_size)

    def mmproj_for(self, spec: str) -> str | None:
        """The projector given for configured model `spec` (None: found beside it, or none)."""
        return dict(self.mmproj).get(spec)
