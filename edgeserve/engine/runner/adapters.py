"""The LoRA adapters an engine serves: names known (from --lora or loaded at runtime), at most `max_loras` of them
resident in memory, the least recently used idle one unloaded to make room; and each request's choice of one.

A request holds its adapter object from admission to its end (`acquire` / `release`), so unloading or reloading a
name never changes the weights of a request already running; its prefix-cache root is the adapter's content digest
and scale (`prefix_key_for`), so a name reloaded with new weights never reuses old KV."""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from edgeserve.errors import QueueFullError, UnknownModelError
from edgeserve.models.config import ModelConfig
from edgeserve.models.lora import AdapterError, LoraAdapter, load_adapter

from ..cache.prefix_key import PrefixKey


class UnknownAdapterError(UnknownModelError):
    """A request named an adapter this engine does not know (HTTP 404, as an unknown model)."""


class AdaptersBusyError(QueueFullError):
    """Every resident adapter is in use by a running request and --max-loras are resident."""


@dataclass(frozen=True)
class AdapterChoice:
    """The adapter a request runs and its scale (llama-server's per-request `lora` scale; 1 otherwise)."""

    adapter: LoraAdapter
    scale: float = 1.0


def prefix_key_for(key: PrefixKey, choice: AdapterChoice | None) -> PrefixKey:
    """`key` with the adapter's digest and scale at the root of its hash chain (unchanged without an adapter)."""
    if choice is None or choice.scale == 0.0:
        return key
    root = choice.adapter.prefix_root(choice.scale)
    return replace(key, root=root if not key.root else root + key.root)


def supports_adapters(model: object) -> bool:
    """Whether this decoder applies adapters (the Llama-family decoder's forward; not the hybrids, MoE or Gemma)."""
    from edgeserve.models.llama import LlamaModel

    return type(model).forward is LlamaModel.forward and all(
        getattr(layer, "moe", None) is None for layer in getattr(model, "layers", []))


def quantized_base(model: object) -> bool:
    """Whether the decoder's projections are stored quantized (GGUF blocks, INT4), not as dense float tensors."""
    layers = getattr(model, "layers", None) or []
    return bool(len(layers)) and not isinstance(getattr(layers[0], "qkv", None), torch.Tensor)


class AdapterStore:
    """Known adapters by name and the resident ones (LRU); thread-safe (the event loop acquires, the engine's worker
    thread releases)."""

    def __init__(self, config: ModelConfig, max_loras: int = 4, model: object = None, weights: str = "auto") -> None:
        self.config = config
        self.max_loras = max_loras
        self.supported = model is None or supports_adapters(model)
        self.decoder = type(model).__name__
        self.device = getattr(model, "device", "cpu")
        # bfloat16 beside a bfloat16 model halves what a step reads; float32 otherwise
        self.dtype = torch.bfloat16 if getattr(model, "dtype", None) == torch.bfloat16 else torch.float32
        # an int8 copy for the native CPU stack halves the bytes a step reads per adapter; beside a quantized base
        # its error (docs/SERVER.md) is far below the base's own
        self.int8 = weights == "int8" or (weights == "auto" and quantized_base(model))
        self.paths: dict[str, Path] = {}  # every known name, in the order it became known
        self._resident: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self._busy: Counter[int] = Counter()  # running requests per adapter object (by id)
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return list(self.paths)

    def register(self, name: str, path: str | Path) -> None:
        """Know `name` at `path` (loaded on its first request). Does not read the files."""
        self._check_name(name)
        with self._lock:
            self.paths[name] = Path(path).expanduser()

    def load(self, name: str, path: str | Path) -> LoraAdapter:
        """Load `name` from `path` now (replacing a resident adapter of that name for new requests; running ones
        keep theirs); raises AdapterError when it does not apply to this model."""
        self._check_name(name)
        adapter = self._read(name, Path(path).expanduser())
        with self._lock:
            self.paths[name] = adapter.path
            self._resident.pop(name, None)
            self._make_room()
            self._resident[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        """Forget `name` (requests running it finish with it); UnknownAdapterError when it is not known."""
        with self._lock:
            if name not in self.paths:
                raise UnknownAdapterError(f"adapter {name!r} is not loaded")
            del self.paths[name]
            self._resident.pop(name, None)

    def acquire(self, name: str, scale: float = 1.0) -> AdapterChoice:
        """The adapter `name` for one request (loaded if it is not resident), held until `release`."""
        with self._lock:
            adapter = self._resident.get(name)
            if adapter is not None:
                self._resident.move_to_end(name)
                self._busy[id(adapter)] += 1
                return AdapterChoice(adapter, scale)
            path = self.paths.get(name)
        if path is None:
            known = ", ".join(self.paths) or "none"
            raise UnknownAdapterError(f"adapter {name!r} is not loaded (loaded adapters: {known})")
        adapter = self._read(name, path)
        with self._lock:
            if self.paths.get(name) != path:
                raise UnknownAdapterError(f"adapter {name!r} was unloaded while it loaded")
            adapter = self._resident.get(name) or adapter  # another request loaded it meanwhile
            if name not in self._resident:
                self._make_room()
                self._resident[name] = adapter
            self._busy[id(adapter)] += 1
            return AdapterChoice(adapter, scale)

    def prefetch(self, name: str) -> None:
        """Make `name` resident now (raising what `acquire` would), so that a request's `acquire` finds it."""
        self.release(self.acquire(name))

    def release(self, choice: AdapterChoice | None) -> None:
        """A request that held `choice` ended."""
        if choice is None:
            return
        with self._lock:
            key = id(choice.adapter)
            self._busy[key] -= 1
            if self._busy[key] <= 0:
                del self._busy[key]

    def resident(self) -> list[str]:
        """The names resident now, least recently used first."""
        with self._lock:
            return list(self._resident)

    def _make_room(self) -> None:
        """Unload idle adapters, least recently used first, until one more fits (the lock is held)."""
        while len(self._resident) >= self.max_loras:
            idle = next((n for n, a in self._resident.items() if not self._busy[id(a)]), None)
            if idle is None:
                raise AdaptersBusyError(f"all {self.max_loras} resident adapters (--max-loras) are running "
                                        "requests; retry when one is idle")
            del self._resident[idle]

    def _read(self, name: str, path: Path) -> LoraAdapter:
        if not self.supported:
            raise AdapterError(f"LoRA adapters are not supported for this {self.config.architecture} model's "
                               f"decoder ({self.decoder}): Llama-family dense decoders only")
        adapter = load_adapter(name, path, self.config).to(self.device, self.dtype)
        adapter.int8 = self.int8
        return adapter

    @staticmethod
    def _check_name(name: str) -> None:
        if not isinstance(name, str) or not name or ":" in name or "/" in name:
            raise AdapterError(f"adapter name {name!r} must be a non-empty name without ':' or '/'")
