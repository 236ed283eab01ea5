"""Device, dtype and memory autodetection: one place that turns `--device` / `--dtype` / `--gpu-memory-fraction`
into a torch device, a compute dtype and a KV pool budget, the same way on every machine.

- `resolve_device("auto")`: `cuda` when torch sees a CUDA device, else `cpu`. `cuda`, `cuda:N` and `cpu` are
  accepted; anything else (`mps`, `rocm`, a typo, `cuda` without CUDA, `cuda:7` on a one-GPU machine) raises a
  one-line `DeviceError` (a CLI error line, an HTTP 400 body), never a traceback.
- `resolve_dtype("auto", device)`: bfloat16 on CPU and on CUDA sm_80+, float16 on older CUDA parts (sm_75 has no
  bfloat16); an explicit dtype is taken as it is (float16/bfloat16 asked for on a device that lacks it is refused).
  A load's `auto` also looks at the file (F32 / F16 matrices): `edgeserve.models.dtype_policy.choose_dtype`.
- `gpu_kv_budget(...)`: the KV pool on a GPU is what `fraction * total` leaves after the weights, the CUDA
  context / other processes, and the peak of a warm-up forward at the largest step (nano-vllm's rule).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from edgeserve.errors import EdgeserveError

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEVICE_RE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


class DeviceError(EdgeserveError, ValueError):
    """A device or dtype that this machine cannot run (HTTP 400, one CLI line)."""


def resolve_device(spec: str | torch.device | None = "auto") -> torch.device:
    """A usable torch device for `spec` ("auto", "cpu", "cuda", "cuda:N"); raises DeviceError otherwise."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    text = (spec or "auto").strip().lower()
    if text == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    m = _DEVICE_RE.match(text)
    if m is None:
        if text.split(":")[0] in ("mps", "xpu", "hip", "rocm", "xla", "meta", "vulkan", "npu"):
            raise DeviceError(f"device {spec!r} is not supported (supported: auto, cpu, cuda, cuda:N)")
        raise DeviceError(f"device {spec!r} is not a device name (use auto, cpu, cuda or cuda:N)")
    kind, index = m.group(1), m.group(2)
    if kind == "cpu":
        if index not in (None, "0"):
            raise DeviceError(f"device {spec!r}: there is only one cpu device")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(f"device {spec!r} asked for, but torch sees no CUDA device here "
                          f"(torch {torch.__version__}{'' if torch.version.cuda else ', a CPU-only build'}); "
                          "use --device cpu or auto")
    n = torch.cuda.device_count()
    if index is not None and int(index) >= n:
        raise DeviceError(f"device {spec!r} does not exist: torch sees {n} CUDA device(s) (cuda:0..cuda:{n - 1})")
    return torch.device("cuda", int(index) if index is not None else torch.cuda.current_device())


def capability(device: torch.device) -> tuple[int, int] | None:
    """CUDA compute capability (major, minor), None off CUDA."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def auto_dtype(device: torch.device, cap: tuple[int, int] | None = None) -> torch.dtype:
    """bfloat16 on CPU and CUDA sm_80+, float16 on older CUDA parts (sm_75: no bfloat16)."""
    if device.type == "cuda":
        cap = cap if cap is not None else capability(device)
        return torch.bfloat16 if cap is not None and cap >= (8, 0) else torch.float16
    return torch.bfloat16


def resolve_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The compute dtype for `name` ("auto", "float32", "bfloat16", "float16") on `device`."""
    if isinstance(name, torch.dtype):
        return name
    key = (name or "auto").strip().lower()
    if key not in DTYPES:
        raise DeviceError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    dtype = DTYPES[key]
    if dtype is None:
        return auto_dtype(device)
    if dtype == torch.bfloat16 and device.type == "cuda" and capability(device) < (8, 0):
        major, minor = capability(device)
        raise DeviceError(f"bfloat16 needs a GPU of compute capability 8.0 or newer; {device} is sm_{major}{minor} "
                          "(use --dtype float16 or auto)")
    return dtype


@dataclass(frozen=True)
class DeviceInfo:
    """What was detected about a device (for logs, /api/ps, the benchmark header)."""

    device: torch.device
    name: str
    capability: tuple[int, int] | None
    total_bytes: int
    free_bytes: int

    def describe(self) -> str:
        cap = f", sm_{self.capability[0]}{self.capability[1]}" if self.capability else ""
        return (f"{self.device} ({self.name}{cap}): {self.free_bytes / 2**30:.1f} of "
                f"{self.total_bytes / 2**30:.1f} GiB free")


def device_info(device: torch.device) -> DeviceInfo:
    """Name, capability and memory of `device` (host RAM via psutil for the CPU)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return DeviceInfo(device, torch.cuda.get_device_name(device), capability(device), int(total), int(free))
    import platform

    import psutil

    vm = psutil.virtual_memory()
    return DeviceInfo(device, platform.processor() or platform.machine() or "cpu", None, int(vm.total),
                      int(vm.available))


def gpu_kv_budget(total: int, free: int, reserved: int, peak: int, fraction: float) -> int:
    """Bytes the KV pool may take on a GPU.

    total / free: `torch.cuda.mem_get_info` now (after the weights are loaded and the warm-up ran);
    reserved: `torch.cuda.memory_reserved` now (what torch's caching allocator holds, used or not);
    peak: `torch.cuda.max_memory_allocated` over the warm-up forward (weights + the largest step's activations);
    fraction: `--gpu-memory-fraction`, the share of the whole device this process may fill.

    Memory used outside torch's allocator (the CUDA context, cuBLAS workspaces, other processes) is
    `total - free - reserved`; what the allocator holds beyond the peak is reusable by the pool, which is
    allocated through the same allocator. The pool gets `fraction * total - non_torch - peak`, never below zero.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {fraction!r}")
    non_torch = max(0, total - free - reserved)
    return max(0, int(fraction * total) - non_torch - peak)
