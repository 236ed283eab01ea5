"""What the KV pool stores per value: the `--kv-cache-dtype` choice, resolved for a model and device.

`auto` (the default) keeps the model's compute dtype, except with bfloat16 compute on the CPU, where it is `f16`: IEEE
half K/V (llama.cpp's default KV type) with the queries and attention outputs in float32, which the native kernels
read as fast as bfloat16 (F16C) and which moves the logits an order of magnitude less from float32 than a bfloat16
pool (docs/MODELS.md, "Served-path drift"; same bytes, so the same tokens per `--kv-cache-gb`). `q8_0` (CPU) stores each head row of
K and V as GGUF q8_0 blocks (kernels.formats.kv_quant: 32 int8 values and a float16 scale, 34 bytes per 32 values), about
half the bytes of bfloat16, so the same `--kv-cache-gb` holds about twice the tokens; the native kernels quantize
where K/V are written and read the blocks directly in attention. `bf16` / `f16` name a float pool: the compute
dtype, or on the CPU `f16` beside bfloat16 compute (as `auto` there); anything else is refused. `fp8` (GPU) stores each head row as e4m3 values and a float32
row scale (kernels.formats.kv_quant: head_dim + 4 bytes), written by the Triton RoPE + KV-write kernel and read inside the
Triton attention kernels; it needs the Triton path on a CUDA GPU with fp8 conversions (compute capability 8.9+),
or Triton's interpreter on the CPU (EDGESERVE_KERNELS=triton, TRITON_INTERPRET=1: tests), and is refused elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgeserve.kernels.formats.kv_quant import Q8_BLOCK, fp8_row_width, q8_row_bytes
from edgeserve.models.config import ModelConfig

from .cache_spec import layer_caches
from .kv_dtypes import KV_CACHE_DTYPES

_FLOAT_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


@dataclass(frozen=True)
class KVFormat:
    """A KV pool's storage: `name` (bf16, f16, f32, q8_0, fp8) and the pool tensors' dtype (uint8 rows for q8_0,
    float8_e4m3fn rows with a scale for fp8)."""

    name: str
    storage: torch.dtype

    @property
    def quantized(self) -> bool:
        return self.name in ("q8_0", "fp8")

    def row_width(self, head_dim: int) -> int:
        """Elements of `storage` one head row of `head_dim` values takes (the pool's last dimension)."""
        if self.name == "q8_0":
            return q8_row_bytes(head_dim)
        return fp8_row_width(head_dim) if self.name == "fp8" else head_dim

    def row_bytes(self, head_dim: int) -> int:
        """Bytes one head row of `head_dim` values takes."""
        return self.row_width(head_dim) * torch.empty((), dtype=self.storage).element_size()


Q8_0 = KVFormat("q8_0", torch.uint8)
FP8 = KVFormat("fp8", torch.float8_e4m3fn)


def as_kv_format(fmt: KVFormat | torch.dtype) -> KVFormat:
    """`fmt` itself, or the plain format that keeps values in the float dtype `fmt`."""
    if isinstance(fmt, KVFormat):
        return fmt
    return KVFormat(_FLOAT_NAMES.get(fmt, str(fmt).removeprefix("torch.")), fmt)


def resolve_kv_format(name: str, config: ModelConfig, compute_dtype: torch.dtype,
                      device: torch.device | str) -> KVFormat:
    """The KV format `--kv-cache-dtype name` means for this model on this device; ValueError (one line, naming the
    flag) where it cannot run there."""
    device = torch.device(device)
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {name!r}")
    if name == "auto":
        return as_kv_format(_f16_beside_bf16(compute_dtype, device) or compute_dtype)
    if name in ("bf16", "f16"):
        wanted = torch.bfloat16 if name == "bf16" else torch.float16
        if wanted != compute_dtype and wanted != _f16_beside_bf16(compute_dtype, device):
            raise ValueError(f"--kv-cache-dtype {name} is not this model's compute dtype here "
                             f"({_FLOAT_NAMES.get(compute_dtype, compute_dtype)}): use auto or q8_0")
        return as_kv_format(wanted)
    if name == "fp8":
        return _fp8_format(config, device)
    if device.type != "cpu":
        raise ValueError(f"--kv-cache-dtype q8_0 runs on the CPU only, not on {device.type}")
    if config.attn_softcap is not None:
        raise ValueError("--kv-cache-dtype q8_0 is not supported for models with attention-logit soft-capping "
                         "(Gemma 2): their attention runs on the torch path, which would dequantize the whole pool")
    dims = sorted({c.head_dim for c in layer_caches(config) if c.owns_kv})
    if any(d % Q8_BLOCK for d in dims):
        raise ValueError(f"--kv-cache-dtype q8_0 needs head sizes that are multiples of {Q8_BLOCK}; this model's "
                         f"are {dims}")
    return Q8_0


def _f16_beside_bf16(compute_dtype: torch.dtype, device: torch.device) -> torch.dtype | None:
    """float16 where a float16 pool runs beside the compute dtype: bfloat16 compute on the CPU (the native kernels
    and the torch twins read it, with float32 queries); None elsewhere (the Triton kernels read the compute dtype)."""
    return torch.float16 if compute_dtype == torch.bfloat16 and device.type == "cpu" else None


def fp8_supported(device: torch.device) -> bool:
    """Whether fp8 KV runs on `device`: the Triton path on CUDA with fp8 conversions (sm_89+), or the Triton
    interpreter on the CPU."""
    from edgeserve.kernels import dispatch
    from edgeserve.kernels.triton.runtime import HAS_TRITON, interpreting

    if device.type == "cpu":
        return HAS_TRITON and interpreting() and dispatch.backend() == "triton"
    return device.type == "cuda" and dispatch.use_triton(device) and torch.cuda.get_device_capability(device) >= (8, 9)


def _fp8_format(config: ModelConfig, device: torch.device) -> KVFormat:
    """FP8 where it runs for this model on this device; ValueError (one line) where it does not."""
    if not fp8_supported(device):
        where = "on the CPU use q8_0" if device.type == "cpu" else "use auto"
        raise ValueError(f"--kv-cache-dtype fp8 needs the Triton kernels on a CUDA GPU with fp8 (compute capability "
                         f"8.9+); not available on {device.type} here: {where}")
    if config.attn_softcap is not None:
        raise ValueError("--kv-cache-dtype fp8 is not supported for models with attention-logit soft-capping "
                         "(Gemma 2): their attention runs on the torch path, which would dequantize the whole pool")
    dims = sorted({c.head_dim for c in layer_caches(config) if c.owns_kv})
    if any(d % 4 for d in dims):
        raise ValueError(f"--kv-cache-dtype fp8 needs head sizes that are multiples of 4; this model's are {dims}")
    return FP8
