"""Whether two builds of the native library (the same variant, e.g. this tree's and another commit's) give the
quantized matmul's results bit for bit: activation quantization, repacking, dequantization and the matmul over every
GGUF format in its GGUF and repacked (_R8 / _X8) layouts, activation rows 1 to 70, float32 and bfloat16 input.

    git archive BASE kernels/cpu | tar -x -C /tmp/base
    gcc -O3 -shared -fPIC -pthread -std=gnu11 <VARIANT_FLAGS> -I/tmp/base/kernels/cpu/include \
        $(find /tmp/base/kernels/cpu/src -name '*.c') -o OLD.so -lm      (before the src/ layout: -I/tmp/base/kernels/cpu
        /tmp/base/kernels/cpu/*.c)
    python benchmarks/kernels/qmm_bits_ab.py OLD.so NEW.so

Prints the number of cases that matched; stops at the first that does not."""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "kernels"))
from edgeserve.kernels.cpu import native as cn  # noqa: E402
from test_cpu_kernels import random_blocks  # noqa: E402

SHAPES = ((16, 8), (24, 3), (8, 16), (40, 9))  # weight rows, K in blocks (x 256 for K formats, else x 32, x 9 for 3)
ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 70)
# the functions this script calls (either library, whatever else its tree has)
QMM_FUNCTIONS = ("qmm_quantize", "qmm_matmul", "qmm_dequant_rows", "qmm_repack", "qmm_repacked_format",
                 "qmm_set_threads", "qmm_variant")


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def same(u: torch.Tensor, v: torch.Tensor) -> bool:
    return torch.equal(u.contiguous().view(torch.uint8), v.contiguous().view(torch.uint8))


def layouts(libs: list, fmt: int, w: torch.Tensor, n: int, k: int) -> list[tuple[int, torch.Tensor]]:
    """The weight in its GGUF layout and, where the format has one, its repacked one (both builds' repacks equal)."""
    out = [(fmt, w)]
    rf = libs[0].qmm_repacked_format(fmt, n)
    assert rf == libs[1].qmm_repacked_format(fmt, n)
    if rf >= 0:
        packed = [torch.empty_like(w) for _ in libs]
        for lib, r in zip(libs, packed):
            lib.qmm_repack(fmt, ptr(w), w.shape[1], n, k, ptr(r))
        assert same(*packed), "repack"
        out.append((rf, packed[0]))
    return out


def run(lib, f: int, w: torch.Tensor, x: torch.Tensor, bf16: int) -> list[torch.Tensor]:
    """(qa, da, sa, out) of one quantize + matmul, and the dequantized rows."""
    (m, k), n = x.shape, w.shape[0]
    qa, da = torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // 32)
    sa, out, rows = torch.empty(m, k // 16, dtype=torch.int16), torch.empty(m, n), torch.empty(n, k)
    lib.qmm_quantize(ptr(x), bf16, k, m, k, ptr(qa), ptr(da), ptr(sa))
    lib.qmm_matmul(f, ptr(w), w.shape[1], n, k, ptr(qa), ptr(da), ptr(sa), m, ptr(out), n)
    ids = torch.arange(n)  # held here: the pointer must outlive the call
    lib.qmm_dequant_rows(f, ptr(w), w.shape[1], k, ptr(ids), n, ptr(rows))
    return [qa, da, sa, out, rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    args = ap.parse_args()
    libs = [cn._bind(ctypes.CDLL(p), QMM_FUNCTIONS) for p in (args.old, args.new)]
    for lib in libs:
        lib.qmm_set_threads(1)
    variants = [lib.qmm_variant().decode() for lib in libs]
    assert variants[0] == variants[1], variants
    gen, checked = np.random.default_rng(0), 0
    for qtype in sorted(cn.GGUF_QTYPES):
        fmt, per, _ = cn.FORMATS[qtype]
        for n, kb in SHAPES:
            k = kb * 256 if per == 256 else kb * 32 * (9 if kb == 3 else 1)
            w = random_blocks(qtype, n, k, gen).data.contiguous()
            for f, ww in layouts(libs, fmt, w, n, k):
                for m in ROWS:
                    for bf16 in (0, 1):
                        x = torch.randn(m, k, generator=torch.Generator().manual_seed(7 * m + bf16))
                        x = x.to(torch.bfloat16) if bf16 else x
                        results = [run(lib, f, ww, x, bf16) for lib in libs]
                        assert all(same(u, v) for u, v in zip(*results)), (qtype, f, m, bf16)
                        checked += 1
    print(f"{variants[0]}: {checked} cases, every result the same bits")


if __name__ == "__main__":
    main()
