"""Native CPU kernels: matmuls over GGUF block formats (kernels/cpu/src/qmm/), paged attention
(kernels/cpu/src/attention.c) and Gated DeltaNet (kernels/cpu/src/gated_delta.c), compiled on first use and cached.

The C sources are built with the system C compiler into `<edgeserve home>/native/` under a name keyed by the
source's hash, the variant and the compiler, and loaded with ctypes. The variant follows the CPU's flags:
`avx512vnni` (AVX-512 VNNI dot products), `avx2` (maddubs), `neondot` / `neon` (ARM NEON with or without the
int8 dot-product instructions), or `scalar` (portable C, always built for tests).
`EDGESERVE_NATIVE=0` turns the native kernels off (the torch paths run instead); `EDGESERVE_NATIVE_VARIANT`
forces a variant. Without a compiler the torch paths run, with one warning.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from edgeserve.kernels.torch.gated_delta import DeltaBatch, check_rule_shapes
from edgeserve.kernels.formats.kv_quant import q8_row_bytes
from edgeserve.kernels.torch.paged_attention import span_ends
from edgeserve.kernels.torch.rope import q_dtype

log = logging.getLogger(__name__)

CPU_DIR = Path(__file__).parent
INCLUDE = CPU_DIR / "include"  # one header per C unit (and the shared inline helpers)


def sources(root: Path = CPU_DIR) -> list[Path]:
    """The C units of the native library under `root` (this checkout's kernels/cpu, or another commit's), any
    subfolder of src/ included."""
    return sorted((root / "src").rglob("*.c"))


def headers(root: Path = CPU_DIR) -> list[Path]:
    """Every header the units include: include/ and the private ones beside the sources."""
    return sorted((root / "include").rglob("*.h")) + sorted((root / "src").rglob("*.h"))


SOURCES = sources()
HEADERS = headers()
# format name -> (id in the C enum, values per block, bytes per block)
FORMATS: dict[str, tuple[int, int, int]] = {
    "Q4_0": (0, 32, 18), "Q4_1": (1, 32, 20), "Q5_0": (2, 32, 22), "Q5_1": (3, 32, 24),
    "Q8_0": (4, 32, 34), "Q4_K": (5, 256, 144), "Q5_K": (6, 256, 176), "Q6_K": (7, 256, 210),
    # layouts made at load for the SIMD kernels (qmm_repack; same bytes): Q4_0 / Q4_1 rows regrouped (_R8), and
    # bands of 8 rows interleaved (_X8, for weights of a multiple of 8 rows)
    "Q4_0_R8": (8, 32, 18), "Q4_1_R8": (9, 32, 20),
    "Q4_K_X8": (10, 256, 144), "Q6_K_X8": (11, 256, 210), "Q5_K_X8": (12, 256, 176), "Q4_0_X8": (13, 32, 18),
    "Q4_1_X8": (14, 32, 20), "Q8_0_X8": (15, 32, 34), "Q5_0_X8": (16, 32, 22), "Q5_1_X8": (17, 32, 24),
    # MXFP4 (gpt-oss experts): an E8M0 exponent byte and 32 4-bit E2M1 codes per block
    "MXFP4": (18, 32, 17), "MXFP4_X8": (19, 32, 17),
}
GGUF_QTYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4")  # the rest: by repacking
REPACKED = {"Q4_0": "Q4_0_R8", "Q4_1": "Q4_1_R8"}  # the twin of any row count
INTERLEAVED = {"Q4_0": "Q4_0_X8", "Q4_1": "Q4_1_X8", "Q5_0": "Q5_0_X8", "Q5_1": "Q5_1_X8", "Q8_0": "Q8_0_X8",
               "Q4_K": "Q4_K_X8", "Q5_K": "Q5_K_X8", "Q6_K": "Q6_K_X8",
               "MXFP4": "MXFP4_X8"}  # for weights of rows % 8 == 0
VARIANT_FLAGS: dict[str, list[str]] = {
    "scalar": [],
    "avx2": ["-DQMM_AVX2", "-mavx2", "-mfma", "-mf16c"],
    "avx512vnni": ["-DQMM_AVX2", "-DQMM_VNNI", "-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw",
                   "-mavx512vl", "-mavx512vnni"],
    "neon": ["-DQMM_NEON"],  # every 64-bit ARM CPU
    "neondot": ["-DQMM_NEON", "-march=armv8.2-a+dotprod"],  # with the int8 dot-product instructions (sdot)
}
VARIANT_NEEDS: dict[str, set[str]] = {
    "scalar": set(),
    "avx2": {"avx2", "fma", "f16c"},
    "avx512vnni": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
    "neon": {"asimd"},
    "neondot": {"asimd", "asimddp"},
}
# the machine each variant compiles for (None: any)
VARIANT_MACHINE: dict[str, str | None] = {"scalar": None, "avx2": "x86_64", "avx512vnni": "x86_64",
                                          "neon": "aarch64", "neondot": "aarch64"}
BEST_FIRST = ("avx512vnni", "avx2", "neondot", "neon", "scalar")
# measured on a 2-core AVX2 EPYC (docs/perf-log/2026-11-to-12.md, single-thread CPU time): the torch fallback against native
FALLBACK_SLOWDOWN = "about 1.4x slower per token, and over 10x slower to load files with Q5_K / Q6_K tensors"

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}
_warned = False


def enabled() -> bool:
    """Whether native kernels may be used at all (EDGESERVE_NATIVE is not 0/false/off)."""
    return os.environ.get("EDGESERVE_NATIVE", "1").strip().lower() not in ("0", "false", "off", "no")


def machine() -> str:
    """This CPU's architecture as VARIANT_MACHINE names it (x86_64, aarch64, ...)."""
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux's /proc/cpuinfo names them ("flags" on x86, "Features" on ARM); on an
    Apple Silicon Mac, which has no such file, the NEON and dot-product features every such chip has."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    if platform.system() == "Darwin" and machine() == "aarch64":
        return frozenset({"asimd", "asimddp"})
    return frozenset()


def compilable_variants(arch: str | None = None) -> list[str]:
    """The variants a compiler for `arch` (default: this machine) can build, best first."""
    arch = machine() if arch is None else arch
    return [v for v in BEST_FIRST if VARIANT_MACHINE[v] in (None, arch)]


def supported_variants(flags: frozenset[str] | None = None, arch: str | None = None) -> list[str]:
    """The variants this CPU can run, best first (always ending with "scalar")."""
    flags = cpu_flags() if flags is None else flags
    return [v for v in compilable_variants(arch) if VARIANT_NEEDS[v] <= flags]


def best_variant() -> str:
    """The variant to run: EDGESERVE_NATIVE_VARIANT when set, else the best the CPU has."""
    forced = os.environ.get("EDGESERVE_NATIVE_VARIANT", "").strip().lower()
    if forced:
        if forced not in VARIANT_FLAGS:
            raise ValueError(f"EDGESERVE_NATIVE_VARIANT must be one of {', '.join(VARIANT_FLAGS)}, not {forced!r}")
        return forced
    return supported_variants()[0]


def compiler() -> str | None:
    """The C compiler to build with ($CC, else cc / gcc / clang on PATH), or None."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _plan(variant: str) -> tuple[str, list[str], Path]:
    """(compiler, flags, cached library path) of `variant`'s build; RuntimeError without a compiler."""
    from edgeserve.registry.paths import edgeserve_home

    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc or clang)")
    flags = ["-O3", "-shared", "-fPIC", "-pthread", "-std=gnu11", *VARIANT_FLAGS[variant]]
    text = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    key = hashlib.sha256(text + " ".join([cc, *flags]).encode()).hexdigest()[:16]
    # the include folder is not in the key: the same sources build the same library wherever they lie
    return cc, [*flags, f"-I{INCLUDE}"], edgeserve_home() / "native" / f"qmatmul-{variant}-{key}.so"


def is_built(variant: str) -> bool:
    """Whether `variant`'s library is compiled and cached already (False too without a compiler)."""
    try:
        return _plan(variant)[2].exists()
    except RuntimeError:
        return False


def build(variant: str) -> Path:
    """Compile (once; cached by source hash, variant and compiler) the shared library for `variant`."""
    cc, flags, target = _plan(variant)
    folder = target.parent
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed to build the native CPU kernels ({variant}):\n{done.stderr.strip()}")
        os.replace(tmp, target)  # atomic: concurrent builders never load a half-written file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# every function of the library that Python calls: (argument types, result type)
SIGNATURES = {
    "qmm_quantize": ([_p, _i32, _i64, _i32, _i32, _p, _p, _p], None),
    "qmm_matmul": ([_i32, _p, _i64, _i32, _i32, _p, _p, _p, _i32, _p, _i64], None),
    "qmm_dequant_rows": ([_i32, _p, _i64, _i32, _p, _i32, _p], None),
    "qmm_set_threads": ([_i32], None),
    "qmm_variant": ([], ctypes.c_char_p),
    "qmm_format_count": ([], _i32),
    "qmm_repack": ([_i32, _p, _i64, _i32, _i32, _p], None),
    "qmm_repacked_format": ([_i32, _i32], _i32),
    "qmm_paged_attention": ([_p, _i32, _i32, _i32, _i32, _p, _p, _i32, _i32, _i32, _p, _i64, _p, _p, _f32, _p], None),
    "qmm_paged_attention_from": ([_p, _i32, _i32, _i32, _i32, _p, _p, _i32, _i32, _i32, _p, _i64, _p, _p, _p, _f32,
                                  _p], None),
    "qmm_paged_attention_sinks": ([_p, _i32, _i32, _i32, _i32, _p, _p, _i32, _i32, _i32, _p, _i64, _p, _p, _p, _p,
                                   _f32, _p], None),
    "qmm_paged_attention_q8": ([_p, _i32, _i32, _i32, _i32, _p, _p, _i32, _i32, _p, _i64, _p, _p, _p, _p, _f32, _p],
                               _i32),
    "qmm_add_rms_norm": ([_p, _i32, _i64, _p, _p, _i32, _i32, _f32, _p, _p, _i32], None),
    "qmm_rope_write_kv": ([_p, _p, _p, _i32, _i64, _i64, _i64, _p, _p, _p, _p, _i32, _p, _i32, _i32, _i32, _i32, _p],
                          None),
    "qmm_rope_write_kv_fmt": ([_p, _p, _p, _i32, _i64, _i64, _i64, _p, _p, _p, _p, _i32, _p, _i32, _i32, _i32, _i32,
                               _p, _i32], None),
    "qmm_silu_mul": ([_p, _i32, _i64, _i32, _i32, _p], None),
    "qmm_gelu_tanh_mul": ([_p, _i32, _i64, _i32, _i32, _p], None),
    "qmm_swiglu_oai_mul": ([_p, _i32, _i64, _i32, _i32, _f32, _f32, _p], None),
    "qmm_softcap": ([_p, _i64, _f32], None),
    "qmm_scaled_norm_add": ([_p, _p, _p, _i32, _i32, _f32, _f32, _f32, _f32, _p], None),
    "qmm_gdn_conv": ([_p, _i64, _i32, _i32, _p, _p, _i32, _p, _i64, _p, _p], None),
    "qmm_gdn_rule": ([_p, _i64, _p, _i64, _p, _i64, _p, _p, _i32, _i32, _i32, _i32, _i32, _p, _i32, _p, _i64, _p, _f32,
                      _p], None),
    "qmm_gdn_rule_rows": ([_p, _i64, _p, _i64, _p, _i64, _p, _p, _i32, _i32, _i32, _i32, _i32, _p, _i32, _p, _i64, _p,
                           _f32, _p, _p], None),  # qmm_gdn_rule's, then the state after every row
    "qmm_gdn_gates": ([_p, _i64, _p, _i64, _i32, _i32, _p, _p, _p, _p], None),
    "qmm_gdn_mix": ([_p, _p, _i32, _p, _i64, _p, _p], None),  # gdn_layer_t *, gdn_step_t *, T, proj, ldp, scratch, out
    "qmm_gdn_replay": ([_p, _p, _p], None),  # gdn_layer_t *, gdn_step_t *, accepted drafts [B]
    "qmm_short_conv": ([_p, _i64, _i32, _i32, _p, _p, _i32, _p, _i64, _p, _p, _p], None),
    "qmm_ssd_rule": ([_p, _p, _p, _i64, _p, _p, _p, _i32, _i32, _i32, _i32, _p, _i32, _p, _i64, _p, _p], None),
    "qmm_ssd_mix": ([_p, _p, _i32, _p, _i64, _p, _p], None),
    "qmm_head_rms_norm": ([_p, _i64, _i64, _p, _i64, _i64, _i32, _i32, _i32, _p, _f32, _p], None),
    "qmm_sigmoid_gate": ([_p, _i32, _p, _i64, _i64, _i64, _i32, _i32, _i32, _p], None),
    "qmm_moe_matmul": ([_i32, _p, _p, _p, _p, _p, _i32, _p, _p, _p, _i32, _p, _p, _p, _i64], _i32),
    "qmm_f32_matmul": ([_p, _i32, _i64, _i32, _p, _i32, _i32, _p, _i64], _i32),
    "qmm_moe_forward": ([_p, _i32, _p, _i32, _i64, _p, _p, _i32, _p], _i32),
    "qmm_moe_release": ([], None),
    "qmm_decoder_forward": ([_p, _i32, _p, _p, _p, _i32, _i32, _p, _p, _p], _i32),
    "qmm_decoder_layout": ([ctypes.c_char_p], _i64),
    "qmm_lora_add": ([_p, _i32, _i32, _p, _i32, _i64, _i32, _i32, _p, _i64, _i32], _i32),
    # the encoders' kernels (kernels.formats.bf16_weight, kernels.cpu.encoder_gelu / encoder_attention): every build
    # has them; where the CPU or build lacks the instructions they say so (bf16_supported 0, bias_gelu nonzero,
    # encoder_attention_available 0)
    "qmm_bf16_packed_size": ([_i32, _i32], _i64),
    "qmm_bf16_pack": ([_p, _i64, _i32, _i32, _p], None),
    "qmm_bf16_supported": ([], _i32),
    "qmm_bf16_matmul": ([_p, _i64, _i32, _i32, _p, _i32, _p, _p, _i64], _i32),
    "qmm_bias_gelu": ([_p, _i64, _i32, _i32, _p], _i32),
    "qmm_bias_gelu_tanh": ([_p, _i64, _i32, _i32, _p], _i32),
    "qmm_encoder_attention": ([_p, _i64, _p, _i64, _p, _i64, _i32, _i32, _i32, _i32, _p, _f32, _p, _i64], _i32),
    "qmm_encoder_attention_available": ([], _i32),
}


def _bind(lib: ctypes.CDLL, names: Iterable[str] = SIGNATURES) -> ctypes.CDLL:
    """`lib` with SIGNATURES' argument and result types (of `names`: a library built from another tree, e.g.
    benchmarks/kernels/qmm_bits_ab.py's, has the functions its caller names), its threads set."""
    for name in names:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = SIGNATURES[name]
    lib.qmm_set_threads(threads())
    return lib


def threads() -> int:
    """Threads for the native matmuls: EDGESERVE_THREADS, else torch's intra-op thread count."""
    value = os.environ.get("EDGESERVE_THREADS", "").strip()
    return int(value) if value else torch.get_num_threads()


def load(variant: str) -> ctypes.CDLL:
    """The library for `variant`, built if needed (raises when it cannot be built)."""
    with _lock:
        lib = _libs.get(variant)
        if lib is None:
            lib = _libs[variant] = _bind(ctypes.CDLL(str(build(variant))))
        return lib


_chosen: dict[tuple[str, str], ctypes.CDLL | None] = {}


def library() -> ctypes.CDLL | None:
    """The native library for this CPU, or None when disabled or unbuildable (warning once in that case)."""
    global _warned
    setting = (os.environ.get("EDGESERVE_NATIVE", "1"), os.environ.get("EDGESERVE_NATIVE_VARIANT", ""))
    if setting in _chosen:  # every kernel call asks: answer from the cache
        return _chosen[setting]
    if not enabled():
        return None
    try:
        lib = _chosen[setting] = load(best_variant())
        return lib
    except (RuntimeError, OSError) as e:
        if not _warned:
            _warned = True
            log.warning("native CPU kernels unavailable (%s); quantized matmuls run on the torch path (%s)",
                        str(e).splitlines()[0], FALLBACK_SLOWDOWN)
        _chosen[setting] = None
        return None


def available() -> bool:
    """Whether quantized CPU matmuls run natively in this process."""
    return library() is not None


def prebuild(say: Callable[[str], None]) -> None:
    """Compile and load this CPU's library now when it is not cached yet, telling `say` before and after (a first
    build takes gcc about 18 s on a 2-core laptop CPU); silent when the kernels are off, cached or cannot be built
    for want of a compiler (then `library` warns once)."""
    try:
        variant = best_variant()
    except ValueError:
        return  # a bad EDGESERVE_NATIVE_VARIANT: the first load says so
    if not enabled() or compiler() is None or is_built(variant):
        library()  # load what is cached (or warn) now rather than inside the first request
        return
    say(f"compiling the native CPU kernels for this CPU ({variant}, with {compiler()}); once per machine, "
        "about 20 s on a laptop ...")
    start = time.perf_counter()
    if library() is None:
        say("the native CPU kernels could not be built; the slower torch paths run")
    else:
        say(f"native CPU kernels ready in {time.perf_counter() - start:.1f} s (cached for the next start)")


@dataclass
class BlockTensor:
    """A 2-D GGUF tensor kept as its block bytes: data [rows, bytes per row] uint8, `cols` values per row."""

    qtype: str
    data: torch.Tensor
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.cols)

    def rows(self, index: torch.Tensor) -> "BlockTensor":
        """The same tensor with its rows reordered by `index` (rows are whole blocks, so this is exact)."""
        return BlockTensor(self.qtype, self.data[index].contiguous(), self.cols)


def quantize_activations(x: torch.Tensor, lib: ctypes.CDLL) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Int8 activation blocks (q [M, K], scales [M, K/32], sums of 16 [M, K/16]) of x [M, K] (float32 or
    bfloat16 rows of unit stride), as qmm_matmul takes them; each row is quantized on its own."""
    m, k = x.shape
    qa = torch.empty(m, k, dtype=torch.int8)
    da = torch.empty(m, k // 32, dtype=torch.float32)
    sa = torch.empty(m, k // 16, dtype=torch.int16)
    lib.qmm_quantize(x.data_ptr(), x.dtype == torch.bfloat16, x.stride(0) if m else k, m, k, qa.data_ptr(),
                     da.data_ptr(), sa.data_ptr())
    return qa, da, sa


def _merge_parts(parts: list[BlockTensor]) -> list[BlockTensor]:
    """Contiguous parts with neighbours of the same format stacked into one (a fused q/k/v or gate/up of one type
    becomes one kernel call per step instead of two or three)."""
    merged: list[BlockTensor] = []
    for p in parts:
        if merged and merged[-1].qtype == p.qtype and merged[-1].data.shape[1] == p.data.shape[1]:
            merged[-1] = BlockTensor(p.qtype, torch.cat([merged[-1].data, p.data]), p.cols)
        else:
            merged.append(BlockTensor(p.qtype, p.data.contiguous(), p.cols))
    return merged


def native_format(qtype: str, cols: int) -> bool:
    """Whether the native kernels take a weight of this type and row length."""
    return qtype in FORMATS and cols % FORMATS[qtype][1] == 0


def repacked(part: BlockTensor, lib: ctypes.CDLL) -> BlockTensor:
    """`part` in the layout the kernels read fastest (qmm_repacked_format: the _X8 bands where the rows are a
    multiple of 8, else Q4_0 / Q4_1's _R8 rows (REPACKED); same size), a new tensor; other formats as they are."""
    if part.qtype not in GGUF_QTYPES:
        return part
    twin_id = lib.qmm_repacked_format(FORMATS[part.qtype][0], part.data.shape[0])
    twin = next((name for name, spec in FORMATS.items() if spec[0] == twin_id), None)
    if twin is None:
        return part
    out = torch.empty_like(part.data)
    lib.qmm_repack(FORMATS[part.qtype][0], part.data.data_ptr(), part.data.shape[1], part.data.shape[0], part.cols,
                   out.data_ptr())
    return BlockTensor(twin, out, part.cols)


def kept_f32_ptr(keep: list[torch.Tensor], t: torch.Tensor | None) -> int | None:
    """The address of `t` as a contiguous float32 tensor that `keep` holds alive for the native decoder (None for
    None)."""
    if t is None:
        return None
    t = t.detach().to(torch.float32).contiguous()
    keep.append(t)
    return t.data_ptr()


def result_buffer(out: torch.Tensor | None, rows: int, cols: int) -> torch.Tensor:
    """A contiguous float32 [rows, cols] for a native kernel's result: the front of `out` (a caller's reused buffer,
    so a large result takes no fresh pages) where given, else a new tensor."""
    if out is None:
        return torch.empty(rows, cols, dtype=torch.float32)
    if out.dtype != torch.float32 or not out.is_contiguous() or out.numel() < rows * cols:
        raise ValueError(f"an output buffer of {tuple(out.shape)} {out.dtype} cannot hold float32 [{rows}, {cols}]")
    return out.view(-1)[:rows * cols].view(rows, cols)


class BlockWeight:
    """A linear weight whose parts (stacked along the output rows, e.g. Q4_K q/k with a Q6_K v) stay in their
    GGUF block formats; `matmul` quantizes the activations once and runs the native kernel per part."""

    def __init__(self, parts: list[BlockTensor], lib: ctypes.CDLL | None = None):
        cols = {p.cols for p in parts}
        if len(cols) != 1:
            raise ValueError(f"parts disagree on in_features: {sorted(cols)}")
        for p in parts:
            if not native_format(p.qtype, p.cols):
                raise ValueError(f"{p.qtype} with {p.cols} columns is not a native format")
        self.lib = lib or library()
        if self.lib is None:
            raise RuntimeError("native CPU kernels are not available")
        self.parts = [repacked(p, self.lib) for p in _merge_parts(parts)]
        self.in_features = parts[0].cols
        self.out_features = sum(p.data.shape[0] for p in parts)
        self._fmt = [FORMATS[p.qtype][0] for p in self.parts]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Int8 activation blocks (q [M, K], scales [M, K/32], sums of 16 [M, K/16]) of x [M, K]."""
        return quantize_activations(x, self.lib)

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] @ W.T -> float32 [..., out], into `out` (a contiguous float32 buffer of at least that many
        values) where given."""
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if x2.dtype not in (torch.float32, torch.bfloat16):
            x2 = x2.float()
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        m = x2.shape[0]
        qa, da, sa = self.quantize(x2)
        out = result_buffer(out, m, self.out_features)
        col, base, row_stride = 0, out.data_ptr(), self.out_features
        for fmt, ptr, row_bytes, n in self.kernel_parts():
            self.lib.qmm_matmul(fmt, ptr, row_bytes, n, self.in_features, qa.data_ptr(), da.data_ptr(),
                                sa.data_ptr(), m, base + 4 * col, row_stride)
            col += n
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)

    def kernel_parts(self) -> list[tuple[int, int, int, int]]:
        """(format id, data pointer, bytes per row, rows) of each part, as qmm_matmul takes them (also what the
        fused layer stack, kernels.cpu.decoder, hands to the C side)."""
        return [(fmt, p.data.data_ptr(), p.data.shape[1], p.data.shape[0]) for fmt, p in zip(self._fmt, self.parts)]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 rows of W for the given ids (an embedding lookup)."""
        if len(self.parts) != 1:
            raise ValueError("row lookups need a single-part weight")
        part = self.parts[0]
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), self.in_features, dtype=torch.float32)
        self.lib.qmm_dequant_rows(self._fmt[0], part.data.data_ptr(), part.data.shape[1], self.in_features,
                                  flat.data_ptr(), flat.numel(), out.data_ptr())
        return out.reshape(*ids.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The whole weight in float32 (for tests and references)."""
        return torch.cat([BlockWeight([p], self.lib).rows(torch.arange(p.data.shape[0])) for p in self.parts])


def block_weight(source: object, names: list[str], device: torch.device, dtype: torch.dtype) -> BlockWeight | None:
    """The tensors `names` (HF names, stacked along the output rows) as one BlockWeight when they can run
    natively here: a CPU device, a reduced-precision compute dtype (float32 keeps the exact dequantized path),
    the native library loaded, and a weight source that gives block bytes (`blocks(name)`) in native formats."""
    if device.type != "cpu" or dtype == torch.float32 or not hasattr(source, "blocks"):
        return None
    lib = library()
    if lib is None:
        return None
    parts = [source.blocks(n) for n in names]  # type: ignore[attr-defined]
    if any(p is None for p in parts):
        return None
    return BlockWeight(parts, lib)


def _attention_rows(meta) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row of a step: its sequence's index and how many positions it sees (a row inside one of
    `meta.attend_spans` sees its whole span), built once per step."""
    plan = getattr(meta, "native_rows", None)
    if plan is None:
        seqs, lens, causal = [], [], []
        spans = getattr(meta, "attend_spans", None)
        for i, (n, s) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
            seqs += [i] * n
            causal += range(s - n + 1, s + 1)
            lens += span_ends(spans[i], s - n, n) if spans is not None else range(s - n + 1, s + 1)
        as_int = functools.partial(torch.tensor, dtype=torch.int32)
        plan = meta.native_rows = (as_int(seqs), as_int(lens), as_int(causal) if spans is not None else None)
    return plan[0], plan[1]


def window_rows(lens: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first key, keys) of each row of a sliding-window layer whose rows see `lens` positions: the last `window`."""
    seen = lens.clamp(max=window)
    return (lens - seen).contiguous(), seen.contiguous()


def visible_rows(meta, window: int | None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(first key or None from 0, keys) of each query row of a step in a layer with `window` (None: global). A row
    in a bidirectional span sees its span's end and, in a window, the keys within the window of its own position:
    keys max(0, p + 1 - window) .. end - 1 (transformers' Gemma 3: window AND (causal OR span))."""
    _, lens = _attention_rows(meta)
    if window is None:
        return None, lens
    causal = meta.native_rows[2]
    if causal is None:
        return window_rows(lens, window)
    lo = (causal - window).clamp(min=0)
    return lo.contiguous(), (lens - lo).contiguous()


def spans_fit_window(meta, window: int) -> bool:
    """Whether, in a layer with `window`, a window taken back from each row's visible length (as the fused stack
    takes it) starts where `visible_rows` starts it: always without spans, and for span rows whose span ends within
    the first `window` keys or whose position is that far in anyway."""
    _, lens = _attention_rows(meta)
    causal = meta.native_rows[2]
    return causal is None or torch.equal((lens - window).clamp(min=0), (causal - window).clamp(min=0))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float | None,
                    lib: ctypes.CDLL | None = None, window: int | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """Causal attention of q [T, H, D] over each sequence's paged K/V (kernels.torch.paged_attention's contract) in
    float32, batch- and chunking-invariant; returns [T, H, D] in q's dtype. `window`: a sliding-window layer;
    `sinks`: float32 [H] attention sinks."""
    lib = lib or library()
    assert lib is not None
    t, h, d = q.shape
    blocks, block_size, hkv, _ = k_cache.shape
    if q.dtype not in (torch.float32, torch.bfloat16):
        q = q.float()
    q = q.contiguous()
    if k_cache.dtype == torch.uint8:
        return _paged_attention_q8(q, k_cache, v_cache, meta, scale, lib, window, sinks)
    kv_bf16 = _KV_FORMAT.get(k_cache.dtype)  # the pools' format (kernels/cpu/include/kv_q8.h)
    if kv_bf16 is None or v_cache.dtype != k_cache.dtype:
        k_cache, v_cache, kv_bf16 = k_cache.float(), v_cache.float(), 0
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()  # no-ops for the engine's pool
    seqs, lens = _attention_rows(meta)
    tables = meta.block_tables if meta.block_tables.dtype == torch.int32 else meta.block_tables.int()
    tables = tables.contiguous()
    out = torch.empty_like(q)
    scale = d ** -0.5 if scale is None else scale
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
        lo, seen = visible_rows(meta, window)
        lib.qmm_paged_attention_sinks(q.data_ptr(), q.dtype == torch.bfloat16, t, h, d, k_cache.data_ptr(),
                                      v_cache.data_ptr(), kv_bf16, block_size, hkv, tables.data_ptr(),
                                      tables.stride(0), seqs.data_ptr(), None if lo is None else lo.data_ptr(),
                                      seen.data_ptr(), sinks.data_ptr(), scale, out.data_ptr())
        return out
    if window is not None:
        lo, seen = visible_rows(meta, window)
        lib.qmm_paged_attention_from(q.data_ptr(), q.dtype == torch.bfloat16, t, h, d, k_cache.data_ptr(),
                                     v_cache.data_ptr(), kv_bf16, block_size, hkv, tables.data_ptr(), tables.stride(0),
                                     seqs.data_ptr(), lo.data_ptr(), seen.data_ptr(), scale, out.data_ptr())
        return out
    lib.qmm_paged_attention(q.data_ptr(), q.dtype == torch.bfloat16, t, h, d, k_cache.data_ptr(), v_cache.data_ptr(),
                            kv_bf16, block_size, hkv, tables.data_ptr(), tables.stride(0), seqs.data_ptr(),
                            lens.data_ptr(), scale, out.data_ptr())
    return out


def _paged_attention_q8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float | None,
                        lib: ctypes.CDLL, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor | None:
    """paged_attention over q8_0 pools (uint8 [blocks, block_size, Hkv, D / 32 * 34], kernels.formats.kv_quant) with
    contiguous float32 / bfloat16 q."""
    t, h, d = q.shape
    block_size, hkv = k_cache.shape[1:3]
    if k_cache.shape[-1] != q8_row_bytes(d) or v_cache.dtype != torch.uint8 or h % hkv:
        raise ValueError(f"q8_0 pools {tuple(k_cache.shape)} do not fit queries {tuple(q.shape)}")
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    seqs, _ = _attention_rows(meta)
    lo, seen = visible_rows(meta, window)
    tables = meta.block_tables if meta.block_tables.dtype == torch.int32 else meta.block_tables.int()
    tables = tables.contiguous()
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
    out = torch.empty_like(q)
    rc = lib.qmm_paged_attention_q8(q.data_ptr(), q.dtype == torch.bfloat16, t, h, d, k_cache.data_ptr(),
                                    v_cache.data_ptr(), block_size, hkv, tables.data_ptr(), tables.stride(0),
                                    seqs.data_ptr(), None if lo is None else lo.data_ptr(), seen.data_ptr(),
                                    None if sinks is None else sinks.data_ptr(), d ** -0.5 if scale is None else scale,
                                    out.data_ptr())
    if rc != 0:
        raise MemoryError(f"q8_0 attention over {t} rows could not allocate its scratch memory")
    return out


_FLOATS = (torch.float32, torch.bfloat16)
# kernels/cpu/include/kv_q8.h's float pool formats (KV_F32, KV_BF16, KV_F16; KV_Q8_0 is 2): the attention reads these pools
_KV_FORMAT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 3}


def _rows(x: torch.Tensor) -> bool:
    """Whether x [T, ...] has unit-stride contiguous rows (any row stride) of float32 or bfloat16."""
    if x.dtype not in _FLOATS or x.dim() < 2:
        return False
    return x[0].is_contiguous() if x.shape[0] else True


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """kernels.torch.norm.add_rms_norm (residual given) or rms_norm (residual None) in one native pass over 2-D
    rows; None when the inputs are not a shape and dtype it takes."""
    lib = library()
    if (lib is None or x.dim() != 2 or not _rows(x) or out_dtype not in _FLOATS or weight.dtype != torch.float32
            or (residual is not None and (residual.dtype != torch.float32 or not residual.is_contiguous()))):
        return None
    t, n = x.shape
    out = torch.empty(t, n, dtype=out_dtype)
    new_residual = torch.empty(t, n, dtype=torch.float32) if residual is not None else out
    lib.qmm_add_rms_norm(x.data_ptr(), x.dtype == torch.bfloat16, x.stride(0) if t else n,
                         residual.data_ptr() if residual is not None else None, weight.contiguous().data_ptr(), t, n,
                         eps, new_residual.data_ptr(), out.data_ptr(), out_dtype == torch.bfloat16)
    return out, new_residual


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """kernels.torch.rope.rope_write_kv in one native pass; None when the inputs are not ones it takes."""
    lib = library()
    dtypes = {q.dtype, k.dtype, v.dtype}
    q8 = k_cache.dtype == torch.uint8  # a q8_0 pool (kernels.formats.kv_quant); q comes back in its own dtype
    if (lib is None or len(dtypes) != 1 or not all(_rows(a) and a[0].stride(0) == a.shape[-1] for a in (q, k, v) if a.shape[0])
            or (k_cache.dtype not in _FLOATS and not q8 and k_cache.dtype != torch.float16)
            or v_cache.dtype != k_cache.dtype or not k_cache.is_contiguous()
            or not v_cache.is_contiguous() or cos.dtype != torch.float32 or sin.dtype != torch.float32):
        return None
    t, h, d = q.shape
    if q8 and k_cache.shape[-1] != q8_row_bytes(d):
        raise ValueError(f"q8_0 pool rows of {k_cache.shape[-1]} bytes do not hold heads of {d} values")
    cos, sin = cos.contiguous(), sin.contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    out = torch.empty(t, h, d, dtype=q_dtype(q, k_cache))
    fmt = 2 if q8 else _KV_FORMAT[k_cache.dtype]  # kernels/cpu/include/kv_q8.h: KV_F32, KV_BF16, KV_Q8_0, KV_F16
    lib.qmm_rope_write_kv_fmt(q.data_ptr(), k.data_ptr(), v.data_ptr(), q.dtype == torch.bfloat16, q.stride(0),
                              k.stride(0), v.stride(0), cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
                              v_cache.data_ptr(), fmt, slots.data_ptr(), t, h, k.shape[1], d, out.data_ptr(),
                              out.dtype == torch.bfloat16)
    return out


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor | None:
    """tanh(x / cap) * cap of float32 x in one native pass (a new tensor); None when the library lacks it or x is
    not float32."""
    lib = library()
    if lib is None or x.dtype != torch.float32:
        return None
    out = x.clone(memory_format=torch.contiguous_format)
    lib.qmm_softcap(out.data_ptr(), out.numel(), cap)
    return out


def scaled_norm_add(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float, a: float, b: float,
                    c: float) -> torch.Tensor | None:
    """kernels.torch.norm.scaled_norm_add in one native pass over float32 rows; None when the inputs are not ones it
    takes."""
    lib = library()
    if (lib is None or x.shape != y.shape or x.dim() != 2
            or not all(t.dtype == torch.float32 for t in (x, y, weight))):
        return None
    x, y, weight = x.contiguous(), y.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    lib.qmm_scaled_norm_add(x.data_ptr(), y.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps, a, b, c,
                            out.data_ptr())
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """kernels.torch.activation.silu_and_mul in one native pass (float32 out); None when the input is not 2-D rows."""
    return _gated_mul(gate_up, "qmm_silu_mul")


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """kernels.torch.activation.gelu_tanh_and_mul in one native pass (float32 out); None when the input is not 2-D rows."""
    return _gated_mul(gate_up, "qmm_gelu_tanh_mul")


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor | None:
    """kernels.torch.activation.swiglu_oai (gpt-oss) in one native pass (float32 out); None when the input is not 2-D
    rows."""
    return _gated_mul(gate_up, "qmm_swiglu_oai_mul", alpha, limit)


def _gated_mul(gate_up: torch.Tensor, kernel: str, *params: float) -> torch.Tensor | None:
    """act(gate) * up of rows [gate | up] through the library's `kernel` (float32 out; `params` after the row
    count and width), or None."""
    lib = library()
    if lib is None or gate_up.dim() != 2 or not _rows(gate_up):
        return None
    t, f2 = gate_up.shape
    out = torch.empty(t, f2 // 2, dtype=torch.float32)
    getattr(lib, kernel)(gate_up.data_ptr(), gate_up.dtype == torch.bfloat16, gate_up.stride(0) if t else f2, t,
                         f2 // 2, *params, out.data_ptr())
    return out


def f32_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """x [T, K] (float32 or bfloat16) @ w.T for a float32 weight w [N, K] as float32 [T, N], each value one
    fixed-order dot product (a row's result does not depend on the other rows); None when the library lacks it or
    the inputs are not CPU rows it takes."""
    lib = library()
    if (lib is None or x.dim() != 2 or not _rows(x) or w.dtype != torch.float32
            or x.device.type != "cpu" or w.device.type != "cpu"):
        return None
    w = w.contiguous()
    t, n = x.shape[0], w.shape[0]
    out = torch.empty(t, n, dtype=torch.float32)
    if lib.qmm_f32_matmul(x.data_ptr(), x.dtype == torch.bfloat16, x.stride(0) if t else x.shape[1], t, w.data_ptr(),
                          n, w.shape[1], out.data_ptr(), n) != 0:
        raise MemoryError(f"the float32 matmul of {t} rows could not allocate its scratch memory")
    return out


# Gated DeltaNet (kernels.torch.gated_delta is the twin and documents the batch and state layouts)
GDN_MAX_CONV_KERNEL = 16  # kernels/cpu/src/gated_delta.c: CONV_MAX_K
GDN_MAX_HEAD_DIM = 512  # GDN_MAX_DIM


def _slot_pool(state: torch.Tensor) -> bool:
    """Whether a state pool [num_slots, ...] is float32 with each slot's block contiguous (any slot stride)."""
    return state.dtype == torch.float32 and state.device.type == "cpu" and (
        state.shape[0] == 0 or state[0].is_contiguous())


def _conv_weight(rows: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, batch: DeltaBatch, c: int,
                 lib: ctypes.CDLL | None) -> torch.Tensor | None:
    """The float32 [C, K] weight of a native causal conv over `rows` into `c` channels; None when the inputs are not
    ones it takes (float32 rows, a float32 state pool, K <= 16); ValueError when the shapes do not fit."""
    k = weight.shape[1]
    if (lib is None or rows.dtype != torch.float32 or not _rows(rows) or not _slot_pool(conv_state)
            or k > GDN_MAX_CONV_KERNEL):
        return None
    batch.check_fits(rows.shape[0], conv_state.shape[0])
    if weight.shape[0] != c or tuple(conv_state.shape[1:]) != (k - 1, c):
        raise ValueError(f"conv weight {tuple(weight.shape)} / state {tuple(conv_state.shape)} do not fit rows "
                         f"{tuple(rows.shape)}")
    return weight.float().contiguous()


def gdn_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, batch: DeltaBatch,
             lib: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """kernels.torch.gated_delta.causal_conv1d_silu in one native call (float32 out); None when the inputs are not
    ones it takes (float32 rows, a float32 state pool, K <= 16)."""
    lib = lib or library()
    t, c = x.shape
    w = _conv_weight(x, weight, conv_state, batch, c, lib)
    if w is None:
        return None
    cu, sl = batch.cu_seqlens, batch.slots
    out = torch.empty(t, c, dtype=torch.float32)
    lib.qmm_gdn_conv(x.data_ptr(), x.stride(0) if t else c, c, w.shape[1], w.data_ptr(), cu.data_ptr(), sl.numel(),
                     conv_state.data_ptr(), conv_state.stride(0), sl.data_ptr(), out.data_ptr())
    return out


def short_conv(bcx: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, batch: DeltaBatch,
               lib: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """kernels.torch.short_conv.gated_short_conv in one native call (float32 out [T, C]: C * conv(B * x) of the rows
    [B | C | x]); None when the inputs are not ones it takes (float32 rows, a float32 state pool, K <= 16)."""
    lib = lib or library()
    t, c3 = bcx.shape
    c = c3 // 3
    w = None if c3 % 3 else _conv_weight(bcx, weight, conv_state, batch, c, lib)
    if w is None:
        return None
    cu, sl = batch.cu_seqlens, batch.slots
    out, scratch = torch.empty(t, c, dtype=torch.float32), torch.empty(t, c, dtype=torch.float32)
    lib.qmm_short_conv(bcx.data_ptr(), bcx.stride(0) if t else c3, c, w.shape[1], w.data_ptr(), cu.data_ptr(),
                       sl.numel(), conv_state.data_ptr(), conv_state.stride(0), sl.data_ptr(), scratch.data_ptr(),
                       out.data_ptr())
    return out


def gdn_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor, batch: DeltaBatch, scale: float | None = None, tiled: bool = False,
             lib: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """kernels.torch.gated_delta.gated_delta_rule in one native call, token by token for every batch (float32 out
    [T, Hv, Dv]); None when the inputs are not ones it takes (float32 heads of
    contiguous values, any row stride: the columns of the conv output as they are; head sizes <= 512)."""
    lib = lib or library()
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    heads_ok = all(a.dtype == torch.float32 and a.dim() == 3 and a.stride(2) == 1 and a.stride(1) == a.shape[2]
                   for a in (q, k, v))
    if (lib is None or not heads_ok or not _slot_pool(state)
            or max(dk, dv) > GDN_MAX_HEAD_DIM):
        return None
    check_rule_shapes(q, k, v, g, beta, state, batch)
    cu, sl = batch.cu_seqlens, batch.slots
    g, beta = g.float().contiguous(), beta.float().contiguous()
    out = torch.empty(t, hv, dv, dtype=torch.float32)
    lib.qmm_gdn_rule(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                     g.data_ptr(), beta.data_ptr(), hk, hv, dk, dv, tiled, cu.data_ptr(), sl.numel(), state.data_ptr(),
                     state.stride(0), sl.data_ptr(), dk ** -0.5 if scale is None else scale, out.data_ptr())
    return out


def gdn_rule_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, batch: DeltaBatch, scale: float | None = None, tiled: bool = False,
                  lib: ctypes.CDLL | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`gdn_rule` also keeping each sequence's state after each of its rows: (out [T, Hv, Dv], row states
    [T, Hv, Dk, Dv]), the twin of kernels.torch.gated_delta.gated_delta_rule_rows; None where `gdn_rule` is None."""
    lib = lib or library()
    if lib is None:
        return None
    t, hv, dv, dk = q.shape[0], v.shape[1], v.shape[2], q.shape[2]
    rows = torch.empty(t, hv, dk, dv, dtype=torch.float32)
    # gdn_rule's checks and arguments, its call made to the entry point that also writes the row states
    rows_lib = _Calls(lib, qmm_gdn_rule=lambda *args: lib.qmm_gdn_rule_rows(*args, rows.data_ptr()))
    out = gdn_rule(q, k, v, g, beta, state, batch, scale, tiled, lib=rows_lib)  # type: ignore[arg-type]
    return None if out is None else (out, rows)


@dataclass
class _Calls:
    """A library whose named functions are replaced (the rest are the library's)."""

    lib: ctypes.CDLL
    qmm_gdn_rule: Callable

    def __getattr__(self, name: str):
        return getattr(self.lib, name)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
              lib: ctypes.CDLL | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """kernels.torch.gated_delta.delta_gates in one native pass: (g, beta) float32 [T, Hv] from a, b [T, Hv] (float32, unit
    stride within a row, any row stride: the projection's columns as they are); None when the inputs are not ones
    it takes."""
    lib = lib or library()
    t, hv = a.shape
    if (lib is None or b.shape != a.shape
            or any(x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(1) != 1 for x in (a, b))):
        return None
    A_log, dt_bias = A_log.float().contiguous(), dt_bias.float().contiguous()
    if A_log.shape != (hv,) or dt_bias.shape != (hv,):
        raise ValueError(f"A_log {tuple(A_log.shape)} / dt_bias {tuple(dt_bias.shape)} must be [{hv}]")
    g, beta = torch.empty(t, hv, dtype=torch.float32), torch.empty(t, hv, dtype=torch.float32)
    lib.qmm_gdn_gates(a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), t, hv, A_log.data_ptr(),
                      dt_bias.data_ptr(), g.data_ptr(), beta.data_ptr())
    return g, beta


def ssd_rule(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor, state: torch.Tensor, batch: DeltaBatch,
             lib: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """kernels.torch.mamba2.ssd_scan in one native call, token by token for every batch (float32 y [T, H, P]), each
    state updated in its slot; None when the library predates it or the inputs are not ones it takes (float32 x
    [T, H, P] and B, C [T, G, N] of unit-stride heads whose rows share one stride: columns of one conv output)."""
    lib = lib or library()
    t, h, p = x.shape
    g, n = B.shape[1:]
    rows = all(a.dtype == torch.float32 and a.device.type == "cpu" and a.dim() == 3 and a.stride(2) == 1
               and a.stride(1) == a.shape[2] and (t < 2 or a.stride(0) == x.stride(0)) for a in (x, B, C))
    if lib is None or not rows or not _slot_pool(state):
        return None
    if C.shape != B.shape or B.shape[0] != t or dt.shape != (t, h) or h % g:
        raise ValueError(f"shapes do not fit: x {tuple(x.shape)} dt {tuple(dt.shape)} B {tuple(B.shape)} "
                         f"C {tuple(C.shape)}")
    if tuple(state.shape[1:]) != (h, p, n):
        raise ValueError(f"ssm state {tuple(state.shape)} must be [num_slots, {h}, {p}, {n}]")
    batch.check_fits(t, state.shape[0])
    dt, A, D = dt.float().contiguous(), A.float().reshape(-1).contiguous(), D.float().reshape(-1).contiguous()
    y = torch.empty(t, h, p, dtype=torch.float32)
    lib.qmm_ssd_rule(x.data_ptr(), B.data_ptr(), C.data_ptr(), x.stride(0) if t > 1 else h * p + 2 * g * n,
                     dt.data_ptr(), A.data_ptr(), D.data_ptr(), h, p, n, g, batch.cu_seqlens.data_ptr(),
                     batch.slots.numel(), state.data_ptr(), state.stride(0), batch.slots.data_ptr(), y.data_ptr())
    return y


def _heads(x: torch.Tensor) -> bool:
    """Whether x [T, H, D] is float32 heads of unit-stride values (any token and head stride)."""
    return x.dtype == torch.float32 and x.dim() == 3 and x.stride(2) == 1 and x.device.type == "cpu"


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, z: torch.Tensor | None = None,
                  lib: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """RMSNorm of each head of x [T, H, D] times weight [D] (and silu(z [T, H, D]) when given: the gated RMSNorm
    of kernels.torch.gated_delta), float32 [T, H, D], read in place whatever the token and head strides; None when the
    inputs are not ones it takes (float32 heads of unit-stride values, D <= 512)."""
    lib = lib or library()
    t, h, d = x.shape
    if (lib is None or not _heads(x) or d > GDN_MAX_HEAD_DIM
            or weight.shape != (d,) or (z is not None and (not _heads(z) or z.shape != x.shape))):
        return None
    w = weight.float().contiguous()
    out = torch.empty(t, h, d, dtype=torch.float32)
    zs = (z.stride(0), z.stride(1)) if z is not None else (0, 0)
    lib.qmm_head_rms_norm(x.data_ptr(), x.stride(0), x.stride(1), z.data_ptr() if z is not None else None, *zs,
                          t, h, d, w.data_ptr(), eps, out.data_ptr())
    return out


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """o [T, H, D] (contiguous, float32 or bfloat16) times sigmoid(gate [T, H, D]), float32 [T, H, D], the gate
    read in place whatever its token and head strides: a gate per value, or one per head expanded over its values
    (stride 0: the sigmoid taken once per head); None when the inputs are not ones it takes."""
    lib = lib or library()
    t, h, d = o.shape
    per_head = gate.dim() == 3 and gate.stride(2) == 0
    if (lib is None or o.dtype not in _FLOATS or not o.is_contiguous() or gate.shape != o.shape
            or not (per_head and gate.dtype == torch.float32 and gate.device.type == "cpu" or _heads(gate))
            or d > GDN_MAX_HEAD_DIM):
        return None
    out = torch.empty(t, h, d, dtype=torch.float32)
    lib.qmm_sigmoid_gate(o.data_ptr(), o.dtype == torch.bfloat16, gate.data_ptr(), gate.stride(0), gate.stride(1),
                         gate.stride(2), t, h, d, out.data_ptr())
    return out
