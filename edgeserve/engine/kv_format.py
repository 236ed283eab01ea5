"""What the KV pool stores per value: the `--kv-cache-dtype` choice, resolved for a model and device.

`auto` (the default) keeps the model's compute dtype (bfloat16 on the CPU). `q8_0` (CPU) stores each head row of
K and V as GGUF q8_0 blocks (kernels.kv_quant: 32 int8 values and a float16 scale, 34 bytes per 32 values), about
half the bytes of bfloat16, so the same `--kv-cache-gb` holds about twice the tokens; the native kernels quantize
where K/V are written and read the blocks directly in attention. `bf16` / `f16` name the compute dtype
explicitly and are refused where they are not it. `fp8` (e4m3 on CUDA) is refused for now.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgeserve.kernels.kv_quant import Q8_BLOCK, q8_row_bytes
from edgeserve.models.config import ModelConfig

from .config import KV_CACHE_DTYPES  # noqa: F401  (re-exported)

_FLOAT_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


@dataclass(frozen=True)
class KVFormat:
    """A KV pool's storage: `name` (bf16, f16, f32, q8_0) and the pool tensors' dtype (uint8 rows for q8_0)."""

    name: str
    storage: torch.dtype

    @property
    def quantized(self) -> bool:
        return self.name == "q8_0"

    def row_width(self, head_dim: int) -> int:
        """Elements of `storage` one head row of `head_dim` values takes (the pool's last dimension)."""
        return q8_row_bytes(head_dim) if self.quantized else head_dim

    def row_bytes(self, head_dim: int) -> int:
        """Bytes one head row of `head_dim` values takes."""
        return self.row_width(head_dim) * torch.empty((), dtype=self.storage).element_size()


Q8_0 = KVFormat("q8_0", torch.uint8)


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
        return as_kv_format(compute_dtype)
    if name in ("bf16", "f16"):
        wanted = torch.bfloat16 if name == "bf16" else torch.float16
        if wanted != compute_dtype:
            raise ValueError(f"--kv-cache-dtype {name} is not this model's compute dtype here "
                             f"({_FLOAT_NAMES.get(compute_dtype, compute_dtype)}): use auto or q8_0")
        return as_kv_format(wanted)
    if name == "fp8":
        raise ValueError("--kv-cache-dtype fp8 (e4m3 on CUDA) is not supported yet: use auto, or q8_0 on the CPU")
    if device.type != "cpu":
        raise ValueError(f"--kv-cache-dtype q8_0 runs on the CPU only, not on {device.type}")
    if config.attn_softcap is not None:
        raise ValueError("--kv-cache-dtype q8_0 is not supported for models with attention-logit soft-capping "
                         "(Gemma 2): their attention runs on the torch path, which would dequantize the whole pool")
    from .kv_cache import kv_owners

    dims = sorted({config.layer_head_dim(i) for i in kv_owners(config)})
    if any(d % Q8_BLOCK for d in dims):
        raise ValueError(f"--kv-cache-dtype q8_0 needs head sizes that are multiples of {Q8_BLOCK}; this model's "
                         f"are {dims}")
    return Q8_0
