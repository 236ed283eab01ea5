"""What one more activation row costs each matmul of a GGUF (a speculative verify step's k + 1 rows, issue 50): the
raw `qmm_matmul` time of every distinct layer matrix and of the output head at 1, 2, 3, 4 and 8 rows, one thread,
for one or more builds of the native library side by side (A/B: the libraries alternate, outputs checked bit-equal).

    python benchmarks/kernels/rows_matmuls.py MODEL.gguf [--lib OLD.so --lib NEW.so] [--rows 1,2,3,4,8]
        [--rounds 3] [--calls 20] [--cold-mb 64]

Without --lib: this checkout's best variant. A matrix is each distinct (name, type, shape) over the file's layers;
a step figure is sum over matrices of (layers holding it) x its time. Thread CPU time (steady on a busy machine),
the median over rounds of each block's median; weights repacked as the engine repacks them (_X8 bands). With
--cold-mb 64 each call reads its weight from memory (copies used in turn, more than the L3 cache), as in a decode step;
without, a weight under the cache size stays cached between calls.
"""

from __future__ import annotations

import argparse
import ctypes
import re
import statistics
import time
from collections import Counter

import torch
from gguf import GGUFReader

from edgeserve.bench.cpu_clock import cpu_clock
from edgeserve.bench.timing import call_times
from edgeserve.kernels.cpu import native as cn


def distinct_matrices(reader: GGUFReader) -> list[tuple[str, int, cn.BlockTensor]]:
    """(label, how many layers hold it, block tensor) of each distinct quantized matrix, the output head last."""
    count: Counter = Counter()
    first: dict[tuple, object] = {}
    head = None
    for t in reader.tensors:
        if t.tensor_type.name not in cn.GGUF_QTYPES or len(t.shape) != 2:
            continue
        m = re.match(r"blk\.\d+\.(.+)\.weight$", t.name)
        if m is None:
            if t.name in ("output.weight", "token_embd.weight") and (head is None or t.name == "output.weight"):
                head = t
            continue
        key = (m.group(1), t.tensor_type.name, tuple(int(s) for s in t.shape))
        count[key] += 1
        first.setdefault(key, t)
    out = [(f"{k[0]} {k[2][1]}x{k[2][0]} {k[1]}", count[k], block(first[k])) for k in first]
    if head is not None:
        out.append((f"head {int(head.shape[1])}x{int(head.shape[0])} {head.tensor_type.name}", 1, block(head)))
    return out


def block(t) -> cn.BlockTensor:
    """The GGUF tensor t as a BlockTensor (rows of block bytes)."""
    data = torch.from_numpy(t.data.reshape(int(t.shape[1]), -1).copy())
    return cn.BlockTensor(t.tensor_type.name, data, int(t.shape[0]))


def timed_call(ws: list[cn.BlockWeight], x: torch.Tensor):
    """(the call, its output tensor) of the raw qmm_matmul over the parts of ws[i] for activations x, i the next
    copy of the weight at each call (copies of one weight: each call reads its weights from memory, not cache)."""
    w, turn = ws[0], [0]
    qa, da, sa = w.quantize(x)
    out = torch.empty(x.shape[0], w.out_features)

    def call() -> None:
        col, w = 0, ws[turn[0] % len(ws)]
        turn[0] += 1
        for fmt, ptr, row_bytes, n in w.kernel_parts():
            w.lib.qmm_matmul(fmt, ptr, row_bytes, n, w.in_features, qa.data_ptr(), da.data_ptr(), sa.data_ptr(),
                             x.shape[0], out.data_ptr() + 4 * col, w.out_features)
            col += n
    return call, out


def measure(libs: dict, part: cn.BlockTensor, m: int, rounds: int, calls: int, clock, copies: int) -> dict[str, float]:
    """Median microseconds per call of each library at m rows (the weight in `copies` copies, used in turn);
    asserts their outputs are the same bits."""
    x = torch.randn(m, part.cols, generator=torch.Generator().manual_seed(m))
    fns = {name: timed_call([cn.BlockWeight([part], lib) for _ in range(copies)], x) for name, lib in libs.items()}
    meds: dict[str, list[float]] = {name: [] for name in libs}
    for _ in range(rounds):
        for name, (fn, _) in fns.items():
            meds[name].append(statistics.median(call_times(fn, calls, warmup=1, clock=clock)) * 1e6)
    outs = [out for _, out in fns.values()]
    assert all(torch.equal(outs[0].view(torch.int32), o.view(torch.int32)) for o in outs[1:]), "results differ"
    return {name: statistics.median(v) for name, v in meds.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--lib", action="append", default=[], help="a built native library (.so); repeat for A/B")
    ap.add_argument("--rows", default="1,2,3,4,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=20, help="calls per block (the head: a quarter)")
    ap.add_argument("--cold-mb", type=int, default=0,
                    help="copies of each weight, used in turn, of at least this many MiB in all: each call streams "
                         "its weight from memory as a decode step does (0: one copy, in cache after the first call)")
    args = ap.parse_args()
    clock = cpu_clock(True)
    if args.lib:
        libs = {p.rsplit("/", 1)[-1]: cn._bind(ctypes.CDLL(p)) for p in args.lib}
    else:
        libs = {"this checkout": cn.load(cn.best_variant())}
    for lib in libs.values():
        lib.qmm_set_threads(1)
    rows = [int(r) for r in args.rows.split(",")]
    mats = distinct_matrices(GGUFReader(args.model))
    step = {(name, m): 0.0 for name in libs for m in rows}
    for label, count, part in mats:
        calls = max(3, args.calls // 4) if label.startswith("head") else args.calls
        for m in rows:
            time.sleep(0.01)
            copies = max(1, -(-args.cold_mb * 2**20 // part.data.numel()))
            us = measure(libs, part, m, args.rounds, calls, clock, copies)
            cells = "  ".join(f"{name} {v:9.1f} us" for name, v in us.items())
            ratio = f"  new/old {list(us.values())[-1] / list(us.values())[0]:.3f}" if len(us) > 1 else ""
            print(f"{label:<36} x{count:<3} rows {m}: {cells}{ratio}", flush=True)
            for name, v in us.items():
                step[(name, m)] += count * v / 1e3
    for name in libs:
        one = step[(name, rows[0])]
        print(f"{name}: step ms " + ", ".join(f"{m} rows {step[(name, m)]:.2f} ({step[(name, m)] / one:.2f}x)"
                                              for m in rows))


if __name__ == "__main__":
    main()
