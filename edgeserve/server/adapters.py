"""LoRA adapters on the server: which adapter a request picks (its `model` as NAME or BASE:NAME, or llama-server's
`lora: [{"id", "scale"}]`), and loading / unloading them at runtime on every loaded engine.

The server keeps the adapters' names and paths (`ModelManager.adapters`, in the order they became known: a name's
index is its llama-server `id`); each engine loads an adapter on its first request and keeps at most --max-loras
resident (engine.runner.adapters.AdapterStore). A bare NAME runs on the default (first configured) model."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import anyio.to_thread

from edgeserve.registry.catalog import CATALOG
from edgeserve.server.errors import APIError, bad_request
from edgeserve.server.model_manager import ModelManager
from edgeserve.server.request import GenerationRequest

MAX_NAME = 128  # characters of an adapter's name
MAX_PATH = 4096  # characters of an adapter's path (Linux's PATH_MAX)
MAX_SCALE = 100.0  # the largest |scale| a request's `lora` entry may ask (1 is the adapter as trained)


def split_adapter(manager: ModelManager, name: str) -> tuple[str, str | None]:
    """(base model name, adapter name or None) of a requested `model`."""
    if name in manager.adapters:
        return adapter_base(manager, name), name
    base, sep, tail = name.rpartition(":")
    if sep and base and tail in manager.adapters:
        return base, tail
    return name, None


def adapter_base(manager: ModelManager, name: str) -> str:
    """The base model adapter `name` runs on when a request names the adapter alone."""
    return manager.adapter_bases.get(name) or manager.default_id()


def pick_adapter(manager: ModelManager, req: GenerationRequest) -> None:
    """Point `req` at its base model and adapter (by model name or the `lora` list); a 400 for a bad `lora`."""
    req.model, named = split_adapter(manager, req.model)
    req.adapter = named or req.adapter
    if req.lora is None:
        return
    names = list(manager.adapters)
    chosen = []
    for i, item in enumerate(req.lora):
        scale = item.get("scale", 1.0) if isinstance(item, dict) else None
        if not isinstance(item, dict) or set(item) - {"id", "scale"} or not isinstance(item.get("id"), int) \
                or isinstance(item.get("id"), bool) or not isinstance(scale, (int, float)) \
                or isinstance(scale, bool) or not math.isfinite(scale):
            raise bad_request(f"lora[{i}] must be an object with an integer id and a numeric scale", "lora")
        if abs(scale) > MAX_SCALE:  # far past any trained strength: the activations overflow to inf / NaN
            raise bad_request(f"lora[{i}].scale {scale:g} is out of range; at most {MAX_SCALE:g} in magnitude "
                              "(1 is the adapter as trained)", "lora")
        if not 0 <= item["id"] < len(names):
            raise bad_request(f"lora[{i}].id {item['id']} is not a loaded adapter (GET /lora-adapters lists "
                              f"{len(names)})", "lora")
        if float(item.get("scale", 1.0)) != 0.0:
            chosen.append((names[item["id"]], float(item.get("scale", 1.0))))
    if len(chosen) > 1 or (chosen and named is not None and chosen[0][0] != named):
        raise bad_request("a request runs at most one adapter (one lora entry with a non-zero scale)", "lora")
    if chosen:
        req.adapter, req.adapter_scale = chosen[0]


async def load_adapter(manager: ModelManager, name: Any, path: Any, base: str | None = None) -> None:
    """Load adapter `name` from `path` for `base` (default: the default model, loaded if needed) now, so a bad
    adapter is refused here; every other loaded engine learns the name too."""
    if not isinstance(name, str) or not name or ":" in name or "/" in name:
        raise bad_request("lora_name must be a non-empty name without ':' or '/'", "lora_name")
    if len(name) > MAX_NAME:
        raise bad_request(f"lora_name is {len(name)} characters; at most {MAX_NAME}", "lora_name")
    if name in manager.known() or name in CATALOG:
        raise bad_request(f"lora_name {name!r} is a model's name (a served or catalog model); pick another name",
                          "lora_name")
    if not isinstance(path, str) or not path:
        raise bad_request("lora_path must be a path to a PEFT folder or a GGUF LoRA file", "lora_path")
    if len(path) > MAX_PATH or "\0" in path:
        raise bad_request(f"lora_path is {len(path)} characters or holds a NUL; a path has at most {MAX_PATH}",
                          "lora_path")
    if name in manager.adapters and manager.adapters[name] != path:
        raise APIError(400, f"adapter {name!r} is already loaded from {manager.adapters[name]}; unload it first",
                       "invalid_request_error", "lora_name")
    lease = await manager.acquire(base or manager.default_id())
    try:
        core = getattr(lease.engine, "core", None)
        if core is None:
            raise bad_request(f"model {lease.entry.id!r} is an embedding model; LoRA adapters run on text "
                              "generation models", "base_model")
        await anyio.to_thread.run_sync(core.adapters.load, name, path)
    finally:
        lease.release()
    manager.adapters[name] = path
    if base:
        manager.adapter_bases[name] = base
    for entry in manager.entries.values():
        if entry.engine is not None and hasattr(entry.engine, "core"):
            entry.engine.core.adapters.register(name, path)


def unload_adapter(manager: ModelManager, name: Any) -> None:
    """Forget adapter `name` on the server and every engine (requests running it finish with it)."""
    if not isinstance(name, str) or name not in manager.adapters:
        raise APIError(404, f"adapter {name!r} is not loaded", "invalid_request_error", "lora_name",
                       "adapter_not_found")
    del manager.adapters[name]
    manager.adapter_bases.pop(name, None)
    for entry in manager.entries.values():
        store = getattr(getattr(entry.engine, "core", None), "adapters", None)
        if store is not None and name in store.paths:
            store.unload(name)


def adapter_entries(manager: ModelManager) -> list[dict[str, Any]]:
    """Each known adapter: id, name, path, the base it runs on by default, size and digest of its files."""
    out = []
    for i, (name, path) in enumerate(manager.adapters.items()):
        p = Path(path).expanduser()
        files = sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else [p] if p.is_file() else []
        h = hashlib.sha256()
        for f in files:
            h.update(f.read_bytes())
        out.append({"id": i, "name": name, "path": path, "base": adapter_base(manager, name),
                    "size": sum(f.stat().st_size for f in files), "digest": h.hexdigest(),
                    "format": "gguf" if p.suffix == ".gguf" else "safetensors"})
    return out
