"""Check the native attention softmax's exp (`qmm_exp` of kernels/cpu/src/attention.c) against this machine's libm
`expf` on every one of the 2^32 float32 inputs, bit for bit (any NaN matches any NaN).

    python benchmarks/kernels/native_exp_check.py [--variant avx2]

The SIMD variants replicate glibc's expf as its FMA build computes it, so that the attention keeps the bits it had
when it called `expf`; this says whether that holds for the libm here. It compiles a small C driver against the
native library (a C compiler is needed, as for the library itself) and takes about a minute.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from edgeserve.kernels.cpu.native import best_variant, build, compiler

DRIVER = r"""
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
void qmm_exp(const float *x, int n, float *out);
int main(void) {
    enum { N = 1 << 20 };
    float *x = malloc(4 * N), *got = malloc(4 * N);
    uint64_t bad = 0;
    for (uint64_t base = 0; base < (1ull << 32); base += N) {
        for (int i = 0; i < N; i++) {
            uint32_t b = (uint32_t)(base + i);
            memcpy(&x[i], &b, 4);
        }
        qmm_exp(x, N, got);
        for (int i = 0; i < N; i++) {
            float want = expf(x[i]);
            if (memcmp(&want, &got[i], 4) != 0 && !(want != want && got[i] != got[i])) {
                if (bad++ < 10) printf("x = %a: libm %a, qmm_exp %a\n", x[i], want, got[i]);
            }
        }
    }
    printf("%llu of 2^32 inputs differ\n", (unsigned long long)bad);
    return bad != 0;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default=best_variant())
    args = ap.parse_args()
    lib = build(args.variant)
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "check.c", Path(tmp) / "check"
        src.write_text(DRIVER)
        subprocess.run([compiler() or "cc", "-O2", str(src), str(lib), "-o", str(exe), "-lm",
                        f"-Wl,-rpath,{lib.parent}"], check=True)
        print(f"variant {args.variant}: ", end="", flush=True)
        raise SystemExit(subprocess.run([str(exe)]).returncode)


if __name__ == "__main__":
    main()
