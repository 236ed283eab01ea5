"""The memory-bandwidth roofline of decode: bytes read per generated token and the tokens/s they allow."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from edgeserve.engine.cache.kv_cache import kv_bytes_per_token


@dataclass
class Roofline:
    """Bytes per decoded token at batch 1 and the tokens/s bound they give at `bandwidth_gbs`."""

    weights_bytes: int  # weights read per token, as stored in the file (GGUF tensor data)
    kv_bytes_per_token: int  # K and V of one context token, all layers, at the KV dtype
    mean_context: float  # context length the KV read is taken at
    bytes_per_token: float
    bandwidth_gbs: float
    bandwidth_source: str  # "--mem-bandwidth-gbs" or "measured host memcpy"
    max_tokens_per_s: float
    measured_tokens_per_s: float | None = None

    @property
    def fraction(self) -> float | None:
        """Measured single-stream rate as a fraction of the bound."""
        return self.measured_tokens_per_s / self.max_tokens_per_s if self.measured_tokens_per_s else None

    def to_dict(self) -> dict:
        return {**asdict(self), "fraction_of_bound": self.fraction}


def gguf_weight_bytes(path: str | Path) -> tuple[int, int]:
    """(bytes of all tensor data in the GGUF, bytes of them read per decoded token). The token embedding is
    only gathered one row per token, so it counts per token only when it doubles as the output head (tied)."""
    from edgeserve.loaders.gguf_file import GGUFFile

    f = GGUFFile(path)
    infos = [f.tensor_info(n) for n in f.tensor_names()]
    total = sum(i.n_bytes for i in infos)
    names = {i.name for i in infos}
    per_token = total
    if "output.weight" in names and "token_embd.weight" in names:
        per_token -= f.tensor_info("token_embd.weight").n_bytes
    return total, per_token


def model_kv_bytes_per_token(path: str | Path, dtype: torch.dtype = torch.bfloat16) -> int:
    """KV bytes one token of context takes (all layers, K and V) for the GGUF's model config."""
    from edgeserve.loaders.gguf_file import GGUFFile
    from edgeserve.models.config import config_from_gguf

    f = GGUFFile(path)
    return kv_bytes_per_token(config_from_gguf(f.metadata, set(f.tensor_names())), dtype)


def measure_memcpy_gbs(size_mb: int = 256, repeats: int = 5) -> float:
    """Host memory bandwidth: bytes read + written per second by a large numpy copy, best of `repeats`, in GB/s."""
    src = np.ones(size_mb * 1024 * 1024 // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch the pages first
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best / 1e9


def roofline(path: str | Path, mean_context: float, bandwidth_gbs: float | None = None,
             kv_dtype: torch.dtype = torch.bfloat16, measured_tokens_per_s: float | None = None) -> Roofline:
    """The batch-1 decode bound for the GGUF at `path`: (weights + KV at `mean_context`) bytes per token over
    `bandwidth_gbs` (measured host memcpy bandwidth when None)."""
    _, weights = gguf_weight_bytes(path)
    kv = model_kv_bytes_per_token(path, kv_dtype)
    source = "--mem-bandwidth-gbs"
    if bandwidth_gbs is None:
        bandwidth_gbs, source = measure_memcpy_gbs(), "measured host memcpy"
    per_token = weights + kv * mean_context
    return Roofline(weights, kv, mean_context, per_token, bandwidth_gbs, source,
                    bandwidth_gbs * 1e9 / per_token, measured_tokens_per_s)
