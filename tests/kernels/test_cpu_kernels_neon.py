"""The ARM NEON variants of the native matmuls (kernels/cpu/src/qmm/, -DQMM_NEON), checked from an x86 machine:
cross-compiled with an aarch64 C compiler and run under qemu's user-mode emulator, against the portable build of
the same sources for aarch64 (the same integer sums, so the same bits) and a float64 reference, every format,
batch invariance included. On an ARM machine tests/kernels/test_cpu_kernels.py runs these variants natively instead.
Skipped where the cross compiler or the emulator is not installed (Debian: gcc-aarch64-linux-gnu, qemu-user)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.cpu.native import FORMATS, INTERLEAVED, REPACKED, SOURCES
from test_cpu_kernels import GGUF_FORMATS, random_blocks

CC, QEMU = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
SYSROOT = Path("/usr/aarch64-linux-gnu")
pytestmark = pytest.mark.skipif(cpu_native.machine() == "aarch64" or not (CC and QEMU and SYSROOT.is_dir()),
                                reason="needs aarch64-linux-gnu-gcc and qemu-aarch64 on a non-ARM machine")
HARNESS = Path(__file__).parents[1] / "native" / "qmm_harness.c"


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, Path]:
    """The harness linked against each aarch64 variant; contraction off so the portable and NEON builds round the
    same float expressions the same way (the shipped build may fuse them, in every path alike)."""
    out = {}
    for variant in cpu_native.compilable_variants("aarch64"):
        exe = tmp_path_factory.mktemp(variant) / "harness"
        subprocess.run([CC, "-O2", "-pthread", "-std=gnu11", "-ffp-contract=off", "-static",
                        *cpu_native.VARIANT_FLAGS[variant], f"-I{cpu_native.INCLUDE}", str(HARNESS),
                        *map(str, SOURCES), "-o", str(exe), "-lm"], check=True)
        out[variant] = exe
    return out


def run(exe: Path, qtype: str, w: np.ndarray, x: np.ndarray, repack: bool) -> tuple[np.ndarray, np.ndarray]:
    """(the batch in one call, each row alone) from the harness under the emulator."""
    fmt = FORMATS[qtype][0]
    m, k = x.shape
    n = w.shape[0]
    head = np.array([fmt, n, k, m, int(repack)], dtype=np.int32).tobytes()
    done = subprocess.run([QEMU, "-L", str(SYSROOT), str(exe)], input=head + w.tobytes() + x.tobytes(),
                          capture_output=True, timeout=300, check=True)
    got = np.frombuffer(done.stdout, dtype=np.float32).reshape(2, m, n)
    return got[0], got[1]


def test_the_variants_are_the_ones_an_arm_cpu_picks(builds):
    assert set(builds) == {"neondot", "neon", "scalar"}
    assert cpu_native.supported_variants(frozenset({"asimd", "asimddp", "fp"}), "aarch64")[0] == "neondot"
    assert cpu_native.supported_variants(frozenset({"asimd", "fp"}), "aarch64")[0] == "neon"
    assert cpu_native.supported_variants(frozenset({"avx2", "fma", "f16c"}), "aarch64") == ["scalar"]


@pytest.mark.parametrize("qtype", GGUF_FORMATS)
@pytest.mark.parametrize("rows", [21, 24])  # 24, repacked: the portable build reads the _X8 bands, NEON does not
def test_neon_matches_the_portable_build_and_float64(builds, qtype, rows):
    gen = np.random.default_rng(sum(map(ord, qtype)))
    per = FORMATS[qtype][1]
    cols = per * (9 if per == 32 else 2) if qtype not in REPACKED else 32 * 19  # repacked groups and a tail
    w = random_blocks(qtype, rows, cols, gen)
    x = gen.standard_normal((6, cols)).astype(np.float32)
    data = w.data.numpy()
    want = x.astype(np.float64) @ dequantize(data, GGMLQuantizationType[qtype]).reshape(w.shape).astype(np.float64).T
    for repack in ([False, True] if qtype in REPACKED or qtype in INTERLEAVED and rows % 8 == 0 else [False]):
        base, _ = run(builds["scalar"], qtype, data, x, repack)
        for variant in ("neon", "neondot"):
            batch, alone = run(builds[variant], qtype, data, x, repack)
            assert np.array_equal(batch, base), (variant, qtype, repack)
            assert np.array_equal(alone, batch), (variant, qtype, repack)  # a row's bits do not depend on the batch
        assert np.abs(base - want).max() <= 0.01 * np.abs(want).max() + 1e-6
