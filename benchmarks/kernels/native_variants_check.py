"""Check the native kernels' SIMD variants against the portable (scalar) build on any machine, without edgeserve's
dependencies (numpy and gcc only): for a machine with AVX-512 VNNI where the test suite cannot be installed.

    python benchmarks/kernels/native_variants_check.py [scalar avx2 avx512vnni | scalar neon neondot]

Builds kernels/cpu/src/**/*.c once per variant (the flags of edgeserve.kernels.cpu.native.VARIANT_FLAGS), multiplies random
blocks of every format (Q4_0 / Q4_1 also in their repacked _R8 layout) by 9 activation rows, and checks that each
variant agrees with the scalar build (relative error below 1e-4) and gives every row the same bits alone as in the
batch. The pytest suite (tests/kernels/test_cpu_kernels.py) checks the variants this CPU can run against float64
references.
"""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

CPU = Path(__file__).resolve().parents[2] / "kernels" / "cpu"
SOURCES = [str(p) for p in sorted((CPU / "src").rglob("*.c"))]  # every unit, as the product builds them
FLAGS = {"scalar": [], "avx2": ["-DQMM_AVX2", "-mavx2", "-mfma", "-mf16c"],
         "avx512vnni": ["-DQMM_AVX2", "-DQMM_VNNI", "-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw",
                        "-mavx512vl", "-mavx512vnni"],
         "neon": ["-DQMM_NEON"], "neondot": ["-DQMM_NEON", "-march=armv8.2-a+dotprod"]}
ARM = platform.machine().lower() in ("aarch64", "arm64")
DEFAULT = ["scalar", "neon", "neondot"] if ARM else ["scalar", "avx2", "avx512vnni"]
# name -> (format id, values per block, bytes per block, byte offsets of the float16 scale fields)
FORMATS = {"Q4_0": (0, 32, 18, [0]), "Q4_1": (1, 32, 20, [0, 2]), "Q5_0": (2, 32, 22, [0]),
           "Q5_1": (3, 32, 24, [0, 2]), "Q8_0": (4, 32, 34, [0]), "Q4_K": (5, 256, 144, [0, 2]),
           "Q5_K": (6, 256, 176, [0, 2]), "Q6_K": (7, 256, 210, [208]), "MXFP4": (18, 32, 17, [])}
EXPONENT_AT = {"MXFP4": 0}  # the byte offset of a block's E8M0 exponent
REPACKED_ID = {0: 8, 1: 9}


def ptr(a: np.ndarray) -> ctypes.c_void_p:
    return a.ctypes.data_as(ctypes.c_void_p)


def build(variant: str) -> ctypes.CDLL:
    """Compile and load the kernels for `variant`."""
    out = f"/tmp/qmm-check-{variant}.so"
    subprocess.run(["gcc", "-O3", "-shared", "-fPIC", "-pthread", "-std=gnu11", *FLAGS[variant], f"-I{CPU / 'include'}", *SOURCES, "-o", out,
                    "-lm"], check=True)
    lib = ctypes.CDLL(out)
    lib.qmm_variant.restype = ctypes.c_char_p
    assert lib.qmm_variant().decode() == variant
    lib.qmm_set_threads(4)
    return lib


def matmul(lib: ctypes.CDLL, fmt: int, w: np.ndarray, k: int, x: np.ndarray) -> np.ndarray:
    """x [M, K] float32 @ W.T through qmm_quantize + qmm_matmul."""
    m, n = x.shape[0], w.shape[0]
    qa, da, sa = np.empty((m, k), np.int8), np.empty((m, k // 32), np.float32), np.empty((m, k // 16), np.int16)
    lib.qmm_quantize(ptr(x), 0, ctypes.c_int64(k), m, k, ptr(qa), ptr(da), ptr(sa))
    out = np.empty((m, n), np.float32)
    lib.qmm_matmul(fmt, ptr(w), ctypes.c_int64(w.shape[1]), n, k, ptr(qa), ptr(da), ptr(sa), m, ptr(out),
                   ctypes.c_int64(n))
    return out


def random_weight(gen: np.random.Generator, n: int, k: int, per: int, size: int, scales: list[int],
                  exponent: int | None = None) -> np.ndarray:
    """Random block bytes with small finite float16 scales (or E8M0 exponents of 2^-11 .. 2^-2 at `exponent`)."""
    w = gen.integers(0, 256, size=(n, k // per, size), dtype=np.uint8)
    if exponent is not None:
        w[:, :, exponent] = gen.integers(117, 127, size=(n, k // per), dtype=np.uint8)
    for off in scales:
        w[:, :, off:off + 2] = (gen.random((n, k // per)) * 0.02 + 0.001).astype(np.float16).view(np.uint8).reshape(
            n, k // per, 2)
    return np.ascontiguousarray(w.reshape(n, -1))


def main() -> int:
    libs = {v: build(v) for v in (sys.argv[1:] or DEFAULT)}
    scalar = libs.get("scalar") or build("scalar")
    gen = np.random.default_rng(0)
    failures = 0
    for name, (fid, per, size, scales) in FORMATS.items():
        n, k = 37, per * (19 if per == 32 else 3)  # 19 blocks of 32: two repacked groups and a tail
        w = random_weight(gen, n, k, per, size, scales, EXPONENT_AT.get(name))
        x = gen.standard_normal((9, k)).astype(np.float32)
        want = matmul(scalar, fid, w, k, x)
        for variant, lib in libs.items():
            for fmt in (fid, REPACKED_ID[fid]) if fid in REPACKED_ID else (fid,):
                wf = w
                if fmt != fid:
                    wf = np.empty_like(w)
                    lib.qmm_repack(fid, ptr(w), ctypes.c_int64(w.shape[1]), n, k, ptr(wf))
                got = matmul(lib, fmt, wf, k, x)
                err = float(np.abs(got - want).max() / np.abs(want).max())
                invariant = all(np.array_equal(matmul(lib, fmt, wf, k, x[i:i + 1])[0], got[i]) for i in (0, 4, 8))
                ok = err < 1e-4 and invariant
                failures += not ok
                print(f"{name + ('_R8' if fmt != fid else ''):<8} {variant:<11} error vs scalar {err:.1e}, "
                      f"batch-invariant {invariant}: {'ok' if ok else 'FAIL'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
