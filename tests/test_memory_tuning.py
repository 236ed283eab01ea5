"""glibc tuning around a model load (edgeserve/memory.py): a load returns large frees to the OS, the steps after it
reuse their buffers' pages instead of faulting in fresh ones."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tiny_gguf import write_tiny_llama

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

# In a fresh process: a heap that earlier work grew would serve the buffers from its free chunks whatever the
# setting, so the "before" figure needs a process that has not allocated them yet.
SCRIPT = """
import resource, sys
import torch
from edgeserve.memory import release_large_frees_to_os
from edgeserve.models.load import load_model
from edgeserve.registry import resolve


def faults_per_buffer(nbytes, calls=9):
    # The median over calls: a heap region that one call maps afresh (another thread's allocation between two
    # calls, seen about one run in three) is not the steady state a step runs in.
    torch.empty(nbytes // 4).fill_(1.0)
    counts = []
    for _ in range(calls):
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(nbytes // 4).fill_(1.0)
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
    return sorted(counts)[calls // 2]


release_large_frees_to_os()  # the setting a load runs under
before = faults_per_buffer(8 << 20)
load_model(resolve(sys.argv[1]), dtype="bfloat16")
print(before, faults_per_buffer(8 << 20))
"""


def test_after_a_load_step_buffers_reuse_their_pages(tmp_path):
    """Minor page faults per allocate-and-fill of an 8 MiB buffer (a step's output): about one per 4 KiB page while
    large frees go back to the OS, next to none once a load has finished."""
    path = write_tiny_llama(tmp_path / "m.gguf")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    before, after = (float(v) for v in done.stdout.split()[-2:])
    pages = (8 << 20) // 4096
    assert before > pages / 8  # (the kernel may map a few pages per fault)
    assert after < pages / 64
