"""The compute dtype a model loads at: the one place that turns `--dtype` and the file's stored matrix type into a
torch dtype, with the reason in words (logged once at load).

- An explicit `--dtype` (float32, bfloat16, float16) is taken as it is (`edgeserve.device.resolve_dtype`).
- `auto` on a file whose layer matrices are stored F32 (a GGUF converted `--outtype f32`, a float32 safetensors
  folder): float32, on every device. The user downloaded float32 weights; keeping them costs no more memory than
  the file, and rounding them to bfloat16 is what moved the served logits 0.15-0.56 nats from transformers on the
  f32 big-MoE files where llama-server (which computes an F32 file in F32) is 0.001-0.011 away (docs/MODELS.md).
- `auto` on a file whose matrices are stored F16, on a CPU: float32 (bfloat16 would drop 3 mantissa bits of every
  weight; the CPU has no fast float16 matmul, torch's is slower than its float32) when the float32 weights, twice
  the file, take at most half the memory available now; else bfloat16, said so. On CUDA an F16 file keeps the
  device default (float16 activations overflow on some models, float32 halves what fits).
- `auto` on anything else (BF16 files, quantized GGUFs, random `dummy` weights, `--quantize int4`): the device default
  (`edgeserve.device.auto_dtype`: bfloat16 on CPUs and CUDA sm_80+), as before.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from edgeserve.registry.resolve import ModelSource, source_bytes

F16_FLOAT32_RAM_FRACTION = 0.5  # an F16 file goes float32 on a CPU when twice its size fits in this share of RAM
_SAFETENSORS_TYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16"}


@dataclass(frozen=True)
class DtypeChoice:
    """The compute dtype of a load and why it was chosen (one log line)."""

    dtype: torch.dtype
    why: str

    def describe(self) -> str:
        return f"compute dtype {str(self.dtype).removeprefix('torch.')}: {self.why}"


def stored_matrix_type(source: ModelSource) -> str | None:
    """The storage type of most of the bytes of the source's layer matrices (tensors of 2+ dimensions inside the
    decoder layers): "F32", "F16", "BF16", a GGUF block type ("Q8_0", "Q4_K", "MXFP4", ...), or None when it
    cannot tell (no such tensors, an unreadable header: the loader reports those itself)."""
    try:
        counts = _gguf_matrix_bytes(source) if source.kind == "gguf" else _safetensors_matrix_bytes(source)
    except Exception:  # noqa: BLE001 - a broken file is load_model's to report, with its own message
        return None
    return counts.most_common(1)[0][0] if counts else None


def _gguf_matrix_bytes(source: ModelSource) -> Counter:
    from edgeserve.loaders.gguf_file import GGUFFile

    gguf = GGUFFile(source.path)
    counts: Counter = Counter()
    for name in gguf.tensor_names():
        info = gguf.tensor_info(name)
        if name.startswith("blk.") and len(info.shape) >= 2:
            counts[info.qtype] += info.n_bytes
    return counts


def _safetensors_matrix_bytes(source: ModelSource) -> Counter:
    from safetensors import safe_open

    counts: Counter = Counter()
    for path in sorted(source.path.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if "layers." not in name:
                    continue
                part = f.get_slice(name)
                shape, kind = part.get_shape(), _SAFETENSORS_TYPES.get(part.get_dtype(), part.get_dtype())
                if len(shape) >= 2:
                    counts[kind] += _numel(shape) * (4 if kind == "F32" else 2)
    return counts


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def choose_dtype(requested: str | torch.dtype | None, device: torch.device, source: ModelSource | None,
                 load_format: str = "auto", quantize: str | None = None) -> DtypeChoice:
    """The compute dtype for a load of `source` on `device` with `--dtype requested` (see the module docstring);
    `quantize` ("int4": the float matrices become 4-bit at load) keeps the device default."""
    from edgeserve.device import resolve_dtype

    default = resolve_dtype(requested, device)  # the device default (auto_dtype) when `requested` is auto
    if isinstance(requested, torch.dtype) or (requested or "auto").strip().lower() != "auto":
        return DtypeChoice(default, "asked for with --dtype")
    if source is None or load_format == "dummy":
        return DtypeChoice(default, f"the {device.type} default")
    if quantize is not None:
        return DtypeChoice(default, f"the {device.type} default (the matrices are quantized to {quantize} at load)")
    stored = stored_matrix_type(source)
    if stored == "F32":
        return DtypeChoice(torch.float32, "the file's matrices are stored F32: kept as they are (no rounding; "
                                          "--dtype bfloat16 halves their memory)")
    if stored == "F16" and device.type == "cpu":
        return _f16_on_cpu(source, default)
    what = f"the file's matrices are stored {stored}" if stored else "the file's storage type is unknown"
    return DtypeChoice(default, f"the {device.type} default ({what})")


def _f16_on_cpu(source: ModelSource, default: torch.dtype) -> DtypeChoice:
    """float32 for an F16 file on a CPU when twice its bytes fit in F16_FLOAT32_RAM_FRACTION of free memory."""
    import psutil

    need, free = 2 * source_bytes(source), psutil.virtual_memory().available
    if need <= F16_FLOAT32_RAM_FRACTION * free:
        return DtypeChoice(torch.float32, "the file's matrices are stored F16: float32 keeps every bit (bfloat16 "
                                          f"would drop 3 mantissa bits; {need / 2**30:.1f} GiB, twice the file; "
                                          "--dtype bfloat16 keeps the file's size)")
    return DtypeChoice(default, f"the file's matrices are stored F16, but float32 ({need / 2**30:.1f} GiB, twice "
                                f"the file) would take more than half of the {free / 2**30:.1f} GiB free: "
                                "rounded to bfloat16 (--dtype float32 keeps every bit)")


def float32_growth(source: ModelSource) -> int:
    """How many times the file's bytes a float32 load of `source` takes: 1 for F32 matrices, 2 for 16-bit ones,
    about 8 for a (4-bit) quantized GGUF's dequantized matrices."""
    stored = stored_matrix_type(source)
    if stored == "F32":
        return 1
    if stored in ("F16", "BF16") or source.kind != "gguf":
        return 2
    return 8
