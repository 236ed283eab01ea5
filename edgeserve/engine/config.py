"""EngineConfig: the knobs of one model's engine (pool size, batch limits, context length)."""

from __future__ import annotations

from dataclasses import dataclass

from edgeserve.offload.config import OffloadConfig

from .scheduler import check_decode_slowdown


@dataclass(frozen=True)
class EngineConfig:
    """Limits of one engine; invalid values raise ValueError naming the field."""

    max_num_seqs: int = 32  # --max-seqs: sequences in one step
    max_num_batched_tokens: int = 512  # --max-batched-tokens: tokens in one step (prefill chunks + decodes)
    max_waiting: int = 256  # --max-queue: waiting requests before new ones are refused as busy
    block_size: int = 16  # tokens per KV block
    kv_cache_gb: float | None = None  # --kv-cache-gb; None: kv_cache_fraction of free memory
    kv_cache_fraction: float = 0.1  # of the memory free after loading, when kv_cache_gb is None (CPU)
    gpu_memory_fraction: float = 0.9  # --gpu-memory-fraction: of the whole GPU, for weights + activations + KV (CUDA)
    enforce_eager: bool = False  # --eager: no CUDA graphs for decode steps (they are only used on CUDA anyway)
    overlap: str = "auto"  # --overlap auto|on|off: launch step N+1 before step N's ids reach the host (auto: on CUDA)
    max_model_len: int | None = None  # --max-model-len; None: the model's own context
    enable_prefix_caching: bool = True
    kv_offload: str = "none"  # --kv-offload none|cpu|cpu,disk: tiers behind the pool (edgeserve.offload)
    cpu_kv_gb: float = 4.0  # --cpu-kv-gb: host tier (and swap space) budget
    disk_kv_gb: float = 16.0  # --disk-kv-gb: disk tier budget
    disk_kv_path: str | None = None  # --disk-kv-path; None: kv/ under the edgeserve cache folder

    def offload_config(self) -> OffloadConfig:
        """The KV offload settings (validated)."""
        return OffloadConfig(self.kv_offload, self.cpu_kv_gb, self.disk_kv_gb, self.disk_kv_path)
    speculative: str | None = None  # --speculative: None (off), "ngram" (prompt lookup) or "draft" (a draft model)
    draft_model: str | None = None  # --draft-model: the draft's name (catalog, .gguf, HF folder) for "draft"
    num_speculative_tokens: int = 4  # --num-speculative-tokens: tokens proposed per sequence per step
    # while sequences decode, a step carries only the prompt tokens that keep its measured cost within this factor
    # of a decode-only step (a long prompt still moves every step); None: every step fills max_num_batched_tokens
    max_decode_slowdown: float | None = 1.5

    def __post_init__(self) -> None:
        self.offload_config()
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.kv_cache_gb is not None and not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb must be positive, got {self.kv_cache_gb!r}")
        if not 0.0 < self.kv_cache_fraction <= 0.95:
            raise ValueError(f"kv_cache_fraction must be in (0, 0.95], got {self.kv_cache_fraction!r}")
        if not (isinstance(self.gpu_memory_fraction, (int, float)) and 0.0 < self.gpu_memory_fraction <= 1.0):
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer of at least 2, got {self.max_model_len!r}")
        if self.overlap not in ("auto", "on", "off"):
            raise ValueError(f"overlap must be 'auto', 'on' or 'off', got {self.overlap!r}")
        if self.speculative not in (None, "ngram", "draft"):
            raise ValueError(f"speculative must be 'ngram' or 'draft', got {self.speculative!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"num_speculative_tokens must be an integer from 1 to 16, got {k!r}")
        if self.draft_model is not None and self.speculative != "draft":
            raise ValueError("draft_model is only used with speculative 'draft'")
        check_decode_slowdown(self.max_decode_slowdown)
