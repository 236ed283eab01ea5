"""GPU timing helpers shared by benchmarks/kernels/kernels_gpu.py and the GPU-marked kernel tests."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def median_ms(fn: Callable[[], object], warmup: int = 5, reps: int = 30) -> float:
    """Median wall time of fn() on the current CUDA stream in milliseconds (CUDA events, L2 not flushed)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_median_ms(fn: Callable[[], object], calls: int = 20, reps: int = 10) -> float:
    """Median device time of one fn() in milliseconds, from replays of a CUDA graph of `calls` calls: what a
    decode step under CUDA graphs pays per kernel, without the host's launch time (L2 not flushed)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles, allocates) outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return median_ms(graph.replay, warmup=2, reps=reps) / calls


def peak_bandwidth_gbs(device: torch.device | str = "cuda") -> float | None:
    """The device's nominal DRAM bandwidth in GB/s from its memory clock and bus width (None if torch lacks them)."""
    props = torch.cuda.get_device_properties(torch.device(device))
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if not clock_khz or not bus_bits:
        return None
    return 2 * bus_bits / 8 * clock_khz * 1e3 / 1e9


def copy_bandwidth_gbs(device: torch.device | str = "cuda", nbytes: int = 1 << 30) -> float:
    """Achieved device-to-device copy bandwidth (bytes read + written per second) in GB/s: a practical roofline."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), warmup=3, reps=10)
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9
