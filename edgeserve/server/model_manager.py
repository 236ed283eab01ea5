"""Lazy model loading, keep-alive idle unload and LRU eviction: one AsyncEngine per loaded model.

A model loads on its first request; concurrent first requests wait for that one load. A model
with no request in flight for `keep_alive` seconds is unloaded (its engine shut down, its
memory returned). With `max_loaded_models` loaded, a new model first unloads the least recently
used idle one. Before a load, weights + KV + activations are estimated against free memory.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup

from edgeserve.errors import UnknownModelError
from edgeserve.registry import CATALOG, ModelSource, is_hf_name, is_pulled, list_local, resolve
from edgeserve.registry.resolve import source_bytes  # noqa: F401 - the server's users import it from here
from edgeserve.server.config import UNSET, ServerConfig
from edgeserve.server.errors import InsufficientMemoryError, ModelsBusyError

log = logging.getLogger("edgeserve.server")



@dataclass
class MemoryEstimate:
    """Bytes a model needs (weights, KV pool, activations) and bytes free where it goes."""

    weights: int
    kv_cache: int
    activations: int
    available: int
    where: str
    host_experts: int = 0  # --cpu-moe-layers: expert bytes kept in host memory (not part of `weights`)
    host_available: int = 0  # free host memory, when host_experts is not 0

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.available and self.host_experts <= self.host_available

    def describe(self) -> str:
        gb = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
        if self.total <= self.available and self.host_experts > self.host_available:
            return (f"keeps {gb(self.host_experts)} of experts in host memory (--cpu-moe-layers) but only "
                    f"{gb(self.host_available)} of host memory is free")
        return (f"needs about {gb(self.total)} (weights {gb(self.weights)} + KV cache {gb(self.kv_cache)} + "
                f"activations {gb(self.activations)}) but only {gb(self.available)} of {self.where} memory is free")


def estimate_memory(source: ModelSource, config: ServerConfig) -> MemoryEstimate:
    """Estimate what loading `source` under `config` takes, against free device (torch) or host (psutil) memory.

    Weights: the file size (4-bit GGUF weights stay packed; float32 dequantizes, about 8x a 4-bit file, 2x a
    16-bit one, 1x an F32 file, which dtype auto keeps at float32: models.dtype_policy;
    `--dense-prefill on` adds a bf16 copy, about 4x).
    KV: --kv-cache-gb when given (otherwise the engine sizes its pool from what is free after the load).
    Activations: about 200 kB per batched token (hidden states, the logits of a step).
    On a GPU, the experts --cpu-moe-layers keeps on the host leave the device's weights and count against free host
    memory instead (`host_expert_bytes`).
    """
    import psutil
    import torch

    if config.load_format == "dummy":  # random weights: the shape says how many bytes, there is no file
        weights = _dummy_weight_bytes(source, config)
    else:
        weights = source_bytes(source)
    from edgeserve.device import resolve_device
    from edgeserve.models.dtype_policy import choose_dtype, float32_growth

    dev = resolve_device(config.device)
    dtype = choose_dtype(config.dtype, dev, source, config.load_format, config.quantize).dtype
    host = 0
    if dev.type == "cuda" and config.cpu_moe_layers is not None:
        from edgeserve.models.cpu_moe_memory import host_expert_bytes

        host = host_expert_bytes(source, config.cpu_moe_layers, dtype, config.load_format)
        # GGUF experts on the host stay as stored; the file's other bytes (or the dummy's dense size) go to the GPU
        weights = max(0, weights - host)
    if dtype == torch.float32 and config.load_format != "dummy":
        weights *= float32_growth(source)
    kv = int(config.engine.kv_cache_gb * 2**30) if config.engine.kv_cache_gb else 0
    activations = config.engine.max_num_batched_tokens * 200_000
    if config.dense_prefill == "on" and dev.type == "cpu" and dtype != torch.float32:
        weights *= 5  # a bf16 copy is about 4x the 4-bit weights (auto only keeps one when it fits easily)
    if dev.type == "cuda":
        available, where = torch.cuda.mem_get_info(dev)[0], f"{dev} device"
    else:
        available, where = psutil.virtual_memory().available, "host"
    return MemoryEstimate(weights, kv, activations, int(available), where, host,
                          int(psutil.virtual_memory().available) if host else 0)


def _dummy_weight_bytes(source: ModelSource, config: ServerConfig) -> int:
    from edgeserve.device import resolve_device, resolve_dtype
    from edgeserve.models.config import config_from_hf
    from edgeserve.models.dummy import int4_group_size, read_config_json, weight_bytes

    cfg = read_config_json(source.path)
    dtype = resolve_dtype(config.dtype, resolve_device(config.device))
    return weight_bytes(config_from_hf(cfg), dtype, int4_group_size(cfg))


@dataclass
class ModelEntry:
    """One model the server has loaded or is loading."""

    id: str
    spec: str  # what resolve() is given
    state: str = "loading"  # loading -> loaded -> unloading
    ready: anyio.Event = field(default_factory=anyio.Event)
    stopped: anyio.Event = field(default_factory=anyio.Event)
    error: BaseException | None = None
    lm: Any = None
    engine: Any = None
    source: ModelSource | None = None
    size_bytes: int = 0
    active: int = 0
    last_used: float = field(default_factory=time.monotonic)
    keep_alive: float | None = None
    load_started: float = field(default_factory=time.monotonic)
    load_started_wall: float = field(default_factory=time.time)
    load_seconds: float | None = None
    embedding: bool = False  # an embedding model: loads beside text models (not counted in max_loaded_models)
    sampling: dict[str, Any] = field(default_factory=dict)  # its recommended sampling: every API's defaults

    def expires_in(self) -> float | None:
        """Seconds until this model is unloaded if no request comes (None: never)."""
        if self.keep_alive is None:
            return None
        if self.active:
            return self.keep_alive
        return max(0.0, self.last_used + self.keep_alive - time.monotonic())


class Lease:
    """A request's hold on a loaded model: the model is not unloaded while any lease is held."""

    def __init__(self, manager: "ModelManager", entry: ModelEntry, keep_alive: Any) -> None:
        self.manager, self.entry, self.keep_alive = manager, entry, keep_alive
        self._released = False

    @property
    def engine(self) -> Any:
        return self.entry.engine

    @property
    def lm(self) -> Any:
        return self.entry.lm

    def release(self) -> None:
        """Give the model back (idempotent); its keep-alive timer starts when no lease is left."""
        if self._released:
            return
        self._released = True
        e = self.entry
        e.active -= 1
        e.last_used = time.monotonic()
        self.manager.wake()


class ModelManager:
    """Loads, hands out and unloads models; runs each model's engine in the app's task group."""

    def __init__(self, config: ServerConfig, on_loaded: Any = None) -> None:
        self.config = config
        self.entries: dict[str, ModelEntry] = {}
        self._tg: TaskGroup | None = None
        self._wake = anyio.Event()
        self._on_loaded = on_loaded  # callback(entry) after a load, for metrics
        # model id -> what to resolve; the configured models first
        self.configured: dict[str, str] = {}
        for spec in config.models:
            self.configured[model_id(spec)] = spec
        # LoRA adapters requests may pick, name -> path (--lora, then runtime loads: edgeserve/server/adapters.py)
        self.adapters: dict[str, str] = dict(config.engine.loras)
        self.adapter_bases: dict[str, str] = {}  # an adapter's base model where not the default (/api/create `from`)

    # --- names ---------------------------------------------------------------------------------------------
    def known(self) -> dict[str, str]:
        """Models a request may name: the configured ones, then pulled catalog models."""
        out = dict(self.configured)
        for src in list_local():
            out.setdefault(src.name, src.name)
        return out

    def default_id(self) -> str:
        """The first configured model."""
        return next(iter(self.configured))

    def canonical(self, name: str) -> tuple[str, str]:
        """(model id, spec) for a requested name: an id, a configured spec or a pulled catalog name ('x:latest' too)."""
        if not isinstance(name, str) or not name:
            raise UnknownModelError("model must be a non-empty string")
        base = name[: -len(":latest")] if name.endswith(":latest") else name
        for mid, spec in self.configured.items():
            if base in (mid, spec):
                return mid, spec
        if base in CATALOG or is_hf_name(base):
            if is_pulled(base):
                return base, base
            raise UnknownModelError(f"model {base!r} is not pulled yet; pull it with `edgeserve pull {base}` "
                                    "or POST /api/pull")
        raise UnknownModelError(f"model {name!r} not found; this server has: {', '.join(self.known())}")

    # --- lifecycle -----------------------------------------------------------------------------------------
    async def run(self, tg: TaskGroup) -> None:
        """Own the task group: engines run in it; this task unloads idle models until cancelled."""
        self._tg = tg
        try:
            while True:
                with anyio.move_on_after(0.1):
                    await self._wake.wait()
                self._wake = anyio.Event()
                for entry in list(self.entries.values()):
                    remaining = entry.expires_in()
                    if entry.state == "loaded" and not entry.active and remaining is not None and remaining <= 0:
                        log.info("model %s idle for %.1fs (keep_alive): unloading", entry.id, entry.keep_alive)
                        await self.unload(entry)
        finally:
            for entry in list(self.entries.values()):
                if entry.engine is not None:
                    entry.engine.shutdown()

    def wake(self) -> None:
        """Let the reaper look at keep-alive timers now."""
        self._wake.set()

    async def acquire(self, name: str, keep_alive: Any = UNSET) -> Lease:
        """Load `name` if needed (sharing a load already under way) and hold it for one request."""
        mid, spec = self.canonical(name)
        while True:
            entry = self.entries.get(mid)
            if entry is None:
                embedding = is_embedding_spec(spec)
                if not embedding:
                    await self._make_room(mid)
                if mid in self.entries:
                    continue
                entry = ModelEntry(mid, spec, keep_alive=self.config.keep_alive, embedding=embedding)
                self.entries[mid] = entry
                assert self._tg is not None, "the model manager is not running"
                self._tg.start_soon(self._load, entry)
            if entry.state == "unloading":
                await entry.stopped.wait()
                continue
            await entry.ready.wait()
            if entry.error is not None:
                raise entry.error
            if entry.state != "loaded":
                continue
            entry.active += 1
            # as in Ollama, each request sets the model's keep-alive when it arrives (its own, else the server
            # default), so the latest request's choice governs, also over requests still running (keep_alive: 0)
            entry.keep_alive = self.config.keep_alive if keep_alive is UNSET else keep_alive
            return Lease(self, entry, keep_alive)

    async def unload(self, entry: ModelEntry) -> None:
        """Shut the model's engine down and drop it, returning its memory."""
        if entry.state != "loaded":
            return
        entry.state = "unloading"
        entry.engine.shutdown()
        await entry.stopped.wait()
        entry.engine = entry.lm = None
        if self.entries.get(entry.id) is entry:
            del self.entries[entry.id]
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:  # pragma: no cover - torch without CUDA
            pass
        log.info("model %s unloaded", entry.id)

    def stop_engines(self) -> None:
        """Tell every loaded engine to stop (the server is stopping): each returns at its next step or sub-batch."""
        for entry in list(self.entries.values()):
            if entry.engine is not None:
                entry.engine.shutdown()

    async def unload_by_name(self, name: str) -> bool:
        """Unload now if loaded and idle, else mark it to unload when its requests finish; True if it was loaded."""
        mid, _ = self.canonical(name)
        entry = self.entries.get(mid)
        if entry is None:
            return False
        entry.keep_alive = 0.0
        if entry.state == "loading":
            await entry.ready.wait()
        if not entry.active:
            await self.unload(entry)
        return True

    async def _make_room(self, mid: str) -> None:
        """Unload least recently used idle models until one more fits under max_loaded_models."""
        while True:
            live = [e for e in self.entries.values() if e.state in ("loading", "loaded") and not e.embedding]
            if len(live) < self.config.max_loaded_models:
                return
            idle = sorted((e for e in live if e.state == "loaded" and not e.active), key=lambda e: e.last_used)
            if not idle:
                raise ModelsBusyError(
                    f"cannot load {mid!r}: {len(live)} model(s) are loaded and busy (--max-loaded-models "
                    f"{self.config.max_loaded_models}); retry when one is idle")
            log.info("unloading %s (least recently used) to make room for %s", idle[0].id, mid)
            await self.unload(idle[0])

    async def _load(self, entry: ModelEntry) -> None:
        """Resolve, check memory, load weights and start the engine (blocking parts in a worker thread)."""
        from edgeserve.engine.runner.embedder import EmbeddingEngine

        cfg = self.config
        log.info("loading model %s (%s)", entry.id, entry.spec)
        try:
            source = await anyio.to_thread.run_sync(lambda: resolve(entry.spec, pull_missing=False))
            estimate = await anyio.to_thread.run_sync(estimate_memory, source, cfg)
            if not estimate.fits:
                raise InsufficientMemoryError(f"model {entry.id!r} does not fit: it {estimate.describe()}")
            entry.source, entry.size_bytes = source, estimate.weights
            entry.sampling = await anyio.to_thread.run_sync(recommended_sampling, entry.spec, source)
            if entry.embedding:  # an embedding model: no KV cache, no sampler
                lm = await anyio.to_thread.run_sync(load_embedder, source, cfg)
                engine = EmbeddingEngine(lm)
            else:
                lm, engine = await self._load_generator(source, cfg.mmproj_for(entry.spec))
        except Exception as e:
            entry.error = e
            entry.state = "failed"
            if self.entries.get(entry.id) is entry:
                del self.entries[entry.id]
            log.warning("model %s failed to load: %s", entry.id, e)
            entry.ready.set()
            entry.stopped.set()
            return
        entry.lm, entry.engine = lm, engine
        entry.load_seconds = time.monotonic() - entry.load_started
        entry.state = "loaded"
        entry.last_used = time.monotonic()
        assert self._tg is not None
        self._tg.start_soon(self._run_engine, entry)
        log.info("model %s loaded in %.2fs (context %d tokens)%s", entry.id, entry.load_seconds, engine.max_model_len,
                 _kv_note(engine))
        if self._on_loaded is not None:
            self._on_loaded(entry)
        entry.ready.set()

    async def _load_generator(self, source: ModelSource, mmproj: str | None) -> tuple[Any, Any]:
        """Load a decoder's weights (with its projector `mmproj`, if given) and start its AsyncEngine (blocking parts
        in a worker thread)."""
        from edgeserve.engine.async_engine import AsyncEngine
        from edgeserve.engine.spec import load_draft_model
        from edgeserve.models.load import load_model
        from edgeserve.vision.runtime import load_runtime

        cfg = self.config
        lm = await anyio.to_thread.run_sync(load_model, source, cfg.load_config())
        lm.vision = await anyio.to_thread.run_sync(load_runtime, source, lm, mmproj)
        engine_cfg = cfg.engine
        draft = await anyio.to_thread.run_sync(load_draft_model, engine_cfg.draft_model, lm)
        # the server's adapter list (the flags' and runtime loads, less unloads) is the engine's
        engine = await anyio.to_thread.run_sync(AsyncEngine, lm, replace(engine_cfg, loras=()), draft)
        for name, path in self.adapters.items():
            engine.core.adapters.register(name, path)
        return lm, engine

    async def _run_engine(self, entry: ModelEntry) -> None:
        try:
            await entry.engine.run()
        except Exception:
            log.exception("engine of %s stopped with an error", entry.id)
        finally:
            entry.stopped.set()
            if entry.state == "loaded":  # the engine died on its own: drop the model so the next request reloads
                entry.state = "unloading"
                entry.engine = entry.lm = None
                if self.entries.get(entry.id) is entry:
                    del self.entries[entry.id]


def _kv_note(engine: Any) -> str:
    """", KV pool 0.70 GiB (why)" for a text model's engine; empty for an embedding model."""
    core = getattr(engine, "core", None)
    plan = getattr(core, "kv_budget", None)
    if plan is None:
        return ""
    return f", KV pool {core.pool.nbytes / 2**30:.2f} GiB ({plan.why})"


def recommended_sampling(spec: str, source: ModelSource) -> dict[str, Any]:
    """The model's recommended sampling (GGUF general.sampling.*, generation_config.json); empty when none."""
    from edgeserve.server.model_details import spec_facts

    facts = spec_facts(spec, source)
    if facts is not None and facts.sampling:
        log.info("model %s: recommended sampling %s (the default where a request sets none)", spec,
                 ", ".join(f"{k}={v}" for k, v in facts.sampling.items()))
    return dict(facts.sampling) if facts is not None else {}


def is_embedding_spec(spec: str) -> bool:
    """Whether `spec` names an embedding model or reranker on disk (see edgeserve.models.encoders.embedders); False when it
    cannot be told."""
    from edgeserve.models.encoders.embedders import is_embedding_source

    try:
        return is_embedding_source(resolve(spec, pull_missing=False))
    except Exception:
        return False


def load_embedder(source: ModelSource, cfg: ServerConfig) -> Any:
    """Load an embedding model or reranker (see edgeserve.models.encoders.embedders)."""
    from edgeserve.models.encoders.embedders import load_embedding_model

    return load_embedding_model(source, cfg.device, cfg.dtype, cfg.engine.max_model_len)


def model_id(spec: str) -> str:
    """The id a configured model is listed under: a catalog name as it is, a path by its file or folder name."""
    if spec in CATALOG or is_hf_name(spec):
        return spec
    from pathlib import Path

    p = Path(spec).expanduser()
    return p.stem if p.suffix.lower() == ".gguf" else p.name or spec
