"""A loaded model's vision: its family, an LRU cache of encoder outputs, and finding the projector to load."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from edgeserve.errors import ModelLoadError
from edgeserve.vision.family import PreparedImage, VisionFamily, has_vision, load_vision
from edgeserve.vision.stop import EncodeAbandoned, checking

log = logging.getLogger("edgeserve.vision")


ENCODE_CHUNK = 2  # images per encoder batch: a request that goes away stops at the next batch
ENCODER_CACHE_IMAGES = 32  # encoder outputs kept (one 256-row Gemma 3 image at 2560 wide: 2.5 MiB)
# The encoder's thread (and the torch worker threads it starts) run this much nicer than the engine: while streams
# decode, their steps take the cores first and the encoder the rest; alone, it still has every core.
ENCODER_NICE = 10


@dataclass
class VisionRuntime:
    """A model's image pipeline: the family, and encoder outputs by image key (an LRU; hits and misses counted)."""

    family: VisionFamily
    capacity: int = ENCODER_CACHE_IMAGES
    hits: int = 0
    misses: int = 0
    encode_seconds: float = 0.0  # time spent in the encoder, all requests
    encoder_nice: int | None = ENCODER_NICE  # the encoder thread's nice increment (None: the caller's thread)
    _cache: OrderedDict[bytes, torch.Tensor] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _worker: ThreadPoolExecutor | None = field(default=None, repr=False)

    def key(self, digest: bytes) -> bytes:
        """An image's key: its pixel digest with the projector and preprocessing settings."""
        import hashlib

        return hashlib.sha256(self.family.settings_digest() + digest).digest()

    def embeddings(self, images: list[PreparedImage], keys: list[bytes],
                   abandoned: Callable[[], bool] | None = None) -> tuple[list[torch.Tensor], float]:
        """Each image's LM embedding rows (from the cache, or encoded now: each distinct image once, in batches of
        up to ENCODE_CHUNK of one size) and the seconds the encoder ran for this call. `abandoned()` is checked
        before each batch and between the tower's layers (vision/stop.py): true raises EncodeAbandoned (the batches
        done stay cached)."""
        out: list[torch.Tensor | None] = []
        with self._lock:
            for k in keys:
                hit = self._cache.get(k)
                if hit is not None:
                    self._cache.move_to_end(k)
                    self.hits += 1
                else:
                    self.misses += 1
                out.append(hit)
        first: dict[bytes, int] = {}  # the same image twice in one request is encoded once
        for i, e in enumerate(out):
            if e is None:
                first.setdefault(keys[i], i)
        t0 = time.perf_counter()
        try:
            for group in _same_shape(images, list(first.values())):
                for start in range(0, len(group), ENCODE_CHUNK):
                    if abandoned is not None and abandoned():
                        raise EncodeAbandoned("the request went away: its images are not encoded")
                    chunk = group[start:start + ENCODE_CHUNK]
                    encoded = [e.detach() for e in self._encode([images[i] for i in chunk], abandoned)]
                    self._remember([keys[i] for i in chunk], encoded)
                    for i, emb in zip(chunk, encoded):
                        out[i] = emb
        finally:
            seconds = time.perf_counter() - t0 if first else 0.0
            with self._lock:
                self.encode_seconds += seconds
        for i, e in enumerate(out):
            if e is None:
                out[i] = out[first[keys[i]]]
        return out, seconds  # type: ignore[return-value]

    def _remember(self, keys: list[bytes], embeds: list[torch.Tensor]) -> None:
        """Put encoder outputs in the LRU cache (the oldest leave past `capacity`)."""
        with self._lock:
            for k, e in zip(keys, embeds):
                self._cache[k] = e
                self._cache.move_to_end(k)
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)

    def _encode(self, images: list[PreparedImage],
                abandoned: Callable[[], bool] | None = None) -> list[torch.Tensor]:
        """The family's encoder over `images`, on the encoder's own low-priority thread (one image batch at a
        time), stopped between layers once `abandoned()` is true."""
        def encode() -> list[torch.Tensor]:
            with checking(abandoned):
                return self.family.encode(images)

        if self.encoder_nice is None:
            return encode()
        with self._lock:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, "edgeserve-encoder", _lower_priority, (self.encoder_nice,))
        return self._worker.submit(encode).result()


def _lower_priority(nice: int) -> None:
    """Make the calling thread (and the threads it starts: torch's OpenMP team) `nice` steps nicer; Linux only,
    where a thread has its own priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + nice)
    except (AttributeError, OSError) as e:  # not Linux, or a sandbox that refuses: the encoder runs at the same pace
        log.debug("the encoder thread keeps its priority: %s", e)


def _same_shape(images: list[PreparedImage], todo: list[int]) -> list[list[int]]:
    """The images to encode grouped by pixel_values shape (one encoder batch each)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i in todo:
        groups.setdefault(tuple(images[i].pixel_values.shape), []).append(i)
    return list(groups.values())


def _load(path: Path, lm: Any) -> VisionFamily:
    """The family at `path` for the loaded model `lm`, its prompt tokens checked against `lm`'s vocabulary."""
    from PIL import Image

    family = load_vision(path, lm.config, dtype=lm.model.dtype, device=lm.model.device)
    family.prompt_tokens(family.preprocess(Image.new("RGB", (32, 32))), lm.tokenizer)  # the tokens it needs exist
    return family


def find_mmproj(model_path: Path) -> Path | None:
    """An mmproj GGUF beside a GGUF model (as `hf.co/...` pulls place it, and llama-server's -hf finds it)."""
    if model_path.suffix.lower() != ".gguf":
        return None
    found = sorted(p for p in model_path.parent.glob("*.gguf") if "mmproj" in p.name.lower() and p != model_path)
    return found[0] if found else None


def load_runtime(source: Any, lm: Any, mmproj: str | Path | None = None) -> VisionRuntime | None:
    """The vision of a loaded model: from `mmproj` when given, else its HF folder's vision tower, else an mmproj
    found beside its GGUF; None for a text-only model."""
    path: Path | None
    if mmproj is not None:
        path = Path(mmproj).expanduser()
        if not path.is_file():
            raise ModelLoadError(f"--mmproj: {path} not found")
    elif source.kind == "hf" and has_vision(source.path):
        path = source.path
    else:
        path = find_mmproj(source.path)
        if path is None:
            return None
    try:
        family = _load(path, lm)
    except ModelLoadError as e:
        if mmproj is not None or source.kind == "hf":
            raise
        # a projector that happened to lie beside the file, made for another model: text only, as before
        log.warning("not using %s for %s: %s", path.name, source.name, e)
        return None
    log.info("vision: %s projector from %s", family.projector_type, path)
    return VisionRuntime(family)
