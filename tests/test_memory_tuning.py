"""glibc tuning around a model load (edgeserve/memory.py): a load returns large frees to the OS, the steps after it
reuse their buffers' pages instead of faulting in fresh ones."""

from __future__ import annotations

import resource
import sys

import pytest
import torch
from tiny_gguf import write_tiny_llama

from edgeserve.memory import release_large_frees_to_os, reuse_step_buffers
from edgeserve.models.load import load_model
from edgeserve.registry import resolve

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

MIB = 1 << 20


def faults_per_buffer(nbytes: int, calls: int = 8) -> float:
    """Minor page faults per allocate-and-fill of an nbytes float32 buffer (a step's output), after a first one."""
    torch.empty(nbytes // 4).fill_(1.0)
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        torch.empty(nbytes // 4).fill_(1.0)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / calls


def test_after_a_load_step_buffers_reuse_their_pages(tmp_path):
    pages = 8 * MIB // 4096
    try:
        release_large_frees_to_os()  # the setting a load runs under: every 8 MiB buffer a fresh mapping
        assert faults_per_buffer(8 * MIB) > pages / 8  # (the kernel may fault in a few pages at a time)
        load_model(resolve(str(write_tiny_llama(tmp_path / "m.gguf"))), dtype="bfloat16")
        assert faults_per_buffer(8 * MIB) < pages / 64
    finally:
        reuse_step_buffers()
