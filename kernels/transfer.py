"""Host <-> device copies that do not wait for the device's queued work.

A blocking host-to-device copy from pageable memory synchronizes the stream, which would stall the host until the
step already queued on the GPU is done; staging through pinned memory and copying with `non_blocking=True` lets the
host build step N+1 while step N runs (the one-step overlap, see edgeserve.engine.core).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`values` (a list or a CPU tensor) as a `dtype` tensor on `device`, without a stream synchronization."""
    device = torch.device(device)
    host = torch.as_tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    if device.type == "cuda" and not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The rows `rows` of `t` (along its first dimension): `t` itself where they are all of its rows in order, else
    an index_select (on the CPU a tenth of what indexing with a tensor costs on [rows, vocabulary] logits)."""
    if rows == list(range(t.shape[0])):
        return t
    return t.index_select(0, to_device(rows, torch.long, t.device))


@dataclass
class HostCopy:
    """Tensors on their way from the device to the host: non-blocking copies and one event to wait on."""

    tensors: object  # a dataclass whose tensor fields are (being) copied to the host
    event: "torch.cuda.Event | None" = None

    @classmethod
    def start(cls, value) -> "HostCopy":
        """Start copying every tensor field of the dataclass `value` to pinned host memory."""
        changes = {}
        event = None
        for f in fields(value):
            t = getattr(value, f.name)
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                changes[f.name] = host
        if changes:
            event = torch.cuda.Event()
            event.record()
        return cls(replace(value, **changes), event)

    def wait(self):
        """The dataclass with its tensors on the host (blocks until the copies are done)."""
        if self.event is not None:
            self.event.synchronize()
        return self.tensors
