"""EngineConfig: the knobs of one model's engine (pool size, batch limits, context length), the root of the config
tree that the CLI, the server (`ServerConfig.engine`) and the Python API (`LLM`) all build directly.

Its scheduling and KV-offload parts are the `SchedulerConfig` and `OffloadConfig` it hands to the scheduler and the
offload tiers (`scheduler_config()`, `offload_config()`). Each field names its command-line flag in its metadata, so
a bad value raises the same one-line ConfigError (a ValueError) on every surface.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edgeserve.errors import check_field, config_error
from edgeserve.offload.config import OffloadConfig

from .cache.kv_dtypes import KV_CACHE_DTYPES
from .sched.scheduler import SchedulerConfig, check_decode_slowdown

LORA_WEIGHTS = ("auto", "int8", "float")  # --lora-weights choices (engine.runner.adapters.AdapterStore)


SPECULATIVE_METHODS = (None, "auto", "off", "ngram", "draft", "mtp")


def _flag(default, flag: str):
    """A field with a default, settable from the command line as `flag`."""
    return field(default=default, metadata={"flag": flag})


@dataclass(frozen=True)
class EngineConfig:
    """Limits of one engine; invalid values raise ConfigError (a ValueError) naming the field and its flag."""

    max_num_seqs: int = _flag(32, "--max-seqs")  # sequences in one step
    max_num_batched_tokens: int = _flag(512, "--max-batched-tokens")  # tokens in one step (prefill chunks + decodes)
    max_waiting: int = _flag(256, "--max-queue")  # waiting requests before new ones are refused as busy
    block_size: int = 16  # tokens per KV block
    kv_cache_gb: float | None = _flag(None, "--kv-cache-gb")  # None: kv_cache_fraction of free memory
    # what the KV pool stores per value (engine.cache.kv_format): auto (the compute dtype) | bf16 | f16 | q8_0 | fp8
    kv_cache_dtype: str = _flag("auto", "--kv-cache-dtype")
    kv_cache_fraction: float = 0.1  # of the memory free after loading, when kv_cache_gb is None (CPU)
    # of the whole GPU, for weights + activations + KV (CUDA)
    gpu_memory_fraction: float = _flag(0.9, "--gpu-memory-fraction")
    enforce_eager: bool = _flag(False, "--eager")  # no CUDA graphs for decode steps (they are only used on CUDA)
    overlap: str = _flag("auto", "--overlap")  # auto|on|off: launch step N+1 before step N's ids reach the host
    max_model_len: int | None = _flag(None, "--max-model-len")  # None: the model's own context
    enable_prefix_caching: bool = _flag(True, "--no-prefix-cache")
    kv_offload: str = _flag("none", "--kv-offload")  # none|cpu|cpu,disk: tiers behind the pool (edgeserve.offload)
    cpu_kv_gb: float = _flag(4.0, "--cpu-kv-gb")  # host tier (and swap space) budget
    disk_kv_gb: float = _flag(16.0, "--disk-kv-gb")  # disk tier budget
    disk_kv_path: str | None = _flag(None, "--disk-kv-path")  # None: kv/ under the edgeserve cache folder
    # "auto" (the model's MTP head where it has one, else off), None / "off", "ngram" (prompt lookup), "draft" (a draft
    # model) or "mtp" (the model's own MTP head: Qwen3.5 / 3.6); the engine resolves it (spec.speculative_method)
    speculative: str | None = _flag("auto", "--speculative")
    draft_model: str | None = _flag(None, "--draft-model")  # the draft's name (catalog, .gguf, HF folder)
    # tokens proposed per sequence per step; None: the method's default (spec.default_num_tokens)
    num_speculative_tokens: int | None = _flag(None, "--num-speculative-tokens")
    # token ids (the lowest) the MTP head drafts within; 0: the whole vocabulary; None: spec.DEFAULT_DRAFT_VOCAB
    spec_draft_vocab: int | None = _flag(None, "--spec-draft-vocab")
    # while sequences decode, a step carries only the prompt tokens that keep its measured cost within this factor
    # of a decode-only step (a long prompt still moves every step); None: every step fills max_num_batched_tokens
    max_decode_slowdown: float | None = _flag(1.5, "--max-decode-slowdown")
    loras: tuple[tuple[str, str], ...] = _flag((), "--lora")  # (name, path) of LoRA adapters requests may pick
    max_loras: int = _flag(4, "--max-loras")  # adapters resident at once (the least recently used idle one goes)
    # what the native CPU stack reads of each adapter: auto (int8 beside a quantized base, else float) | int8 | float
    lora_weights: str = _flag("auto", "--lora-weights")

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting", "block_size", "max_loras"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise config_error(EngineConfig, name, "be a positive integer", value)
        if self.kv_cache_gb is not None and not (isinstance(self.kv_cache_gb, (int, float)) and self.kv_cache_gb > 0):
            raise config_error(EngineConfig, "kv_cache_gb", "be positive", self.kv_cache_gb)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise config_error(EngineConfig, "kv_cache_dtype", f"be one of {', '.join(KV_CACHE_DTYPES)}",
                               self.kv_cache_dtype)
        if not 0.0 < self.kv_cache_fraction <= 0.95:
            raise config_error(EngineConfig, "kv_cache_fraction", "be in (0, 0.95]", self.kv_cache_fraction)
        if not (isinstance(self.gpu_memory_fraction, (int, float)) and 0.0 < self.gpu_memory_fraction <= 1.0):
            raise config_error(EngineConfig, "gpu_memory_fraction", "be in (0, 1]", self.gpu_memory_fraction)
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise config_error(EngineConfig, "max_model_len", "be an integer of at least 2", self.max_model_len)
        if self.overlap not in ("auto", "on", "off"):
            raise config_error(EngineConfig, "overlap", "be 'auto', 'on' or 'off'", self.overlap)
        if self.lora_weights not in LORA_WEIGHTS:
            raise config_error(EngineConfig, "lora_weights", f"be one of {', '.join(LORA_WEIGHTS)}", self.lora_weights)
        if self.speculative not in SPECULATIVE_METHODS:
            raise config_error(EngineConfig, "speculative", "be one of " + ", ".join(m for m in SPECULATIVE_METHODS
                                                                                   if m), self.speculative)
        k = self.num_speculative_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16):
            raise config_error(EngineConfig, "num_speculative_tokens", "be an integer from 1 to 16", k)
        v = self.spec_draft_vocab
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise config_error(EngineConfig, "spec_draft_vocab", "be a non-negative integer (0: the whole vocabulary)",
                               v)
        if self.draft_model is not None and self.speculative not in ("draft", "auto"):
            raise config_error(EngineConfig, "draft_model", "be used with speculative 'draft' only", self.draft_model)
        check_field(self, "max_decode_slowdown", "be a number of at least 1.0 or None", check_decode_slowdown)
        self.offload_config()

    def offload_config(self) -> OffloadConfig:
        """The KV offload part (validated)."""
        return OffloadConfig(self.kv_offload, self.cpu_kv_gb, self.disk_kv_gb, self.disk_kv_path)

    def scheduler_config(self) -> SchedulerConfig:
        """The scheduling part: batch limits, block size, and a waiting queue with room for preempted requests
        (they rejoin it on top of the engine's own admission limit, `max_waiting`)."""
        return SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                               max_waiting=self.max_waiting + self.max_num_seqs, block_size=self.block_size,
                               max_decode_slowdown=self.max_decode_slowdown)
