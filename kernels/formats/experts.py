"""The experts of a Mixture-of-Experts layer: one projection of every expert held together, and the grouped matmul
that runs a step's routed rows through the experts they were sent to.

A step's (token, slot) rows are sorted by expert once (`ExpertGroups`), so each active expert's rows are
contiguous and its weights are read once per step for all of them. Every row is computed on its own in a fixed
order (native kernels: row-independent int8 dot products; dense weights: fixed tiles), so a token's result does
not depend on what else is in the step.
"""

from __future__ import annotations

import ctypes
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.cpu.native import FORMATS, GGUF_QTYPES, native_format, quantize_activations
from edgeserve.kernels.host_pages import release_pages
from edgeserve.kernels.formats.quant_linear import dense_tiles

EXPERT_TILE = 16  # rows per dense matmul of the torch path (fixed, for batch invariance)


@dataclass
class ExpertGroups:
    """A step's routed rows sorted by expert: sorted row i is slot `slot[i]` of token `token[i]`, sent to
    `expert[i]`; `active` lists (expert, start, end) of each expert that got rows, in expert order."""

    token: torch.Tensor  # [N] long
    expert: torch.Tensor  # [N] long
    inverse: torch.Tensor  # [N] long: the sorted position of flat row token * k + slot
    active: list[tuple[int, int, int]]
    active_ids: torch.Tensor  # int32 [A]: the active experts (CPU), as the native grouped matmul takes them
    starts: torch.Tensor  # int32 [A + 1]: where each active expert's rows start, then N

    @classmethod
    def build(cls, experts: torch.Tensor, num_experts: int) -> "ExpertGroups":
        """Group the routing choice `experts` [T, k] (expert ids) by expert; within an expert, rows keep token
        order."""
        t, k = experts.shape
        flat = experts.reshape(-1).to(torch.long)
        order = torch.sort(flat, stable=True).indices
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        counts = torch.bincount(flat, minlength=num_experts).tolist()
        active, start = [], 0
        for e, n in enumerate(counts):
            if n:
                active.append((e, start, start + n))
                start += n
        ids = torch.tensor([a[0] for a in active], dtype=torch.int32)
        starts = torch.tensor([a[1] for a in active] + [start], dtype=torch.int32)
        return cls(order // k if k else order, flat[order], inverse, active, ids, starts)

    @property
    def rows(self) -> int:
        return self.token.numel()


class DenseExperts:
    """One projection of every expert as a dense tensor [E, rows, cols] (the torch path: GPUs, float32 mode,
    safetensors checkpoints)."""

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 3:
            raise ValueError(f"expert weights must be [experts, rows, cols], not {tuple(weight.shape)}")
        self.weight = weight

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.weight.shape)  # type: ignore[return-value]

    def grouped(self, x: torch.Tensor, groups: ExpertGroups, gather: bool) -> torch.Tensor:
        """float32 [N, rows]: sorted row i times its expert's weight; its input is x[groups.token[i]] when
        `gather`, else x[i]."""
        rows = self.weight.shape[1]
        out = torch.empty(groups.rows, rows, dtype=torch.float32, device=x.device)
        x = x.to(self.weight.dtype)
        for e, s, t in groups.active:
            xs = x[groups.token[s:t]] if gather else x[s:t]
            out[s:t] = dense_tiles(xs, self.weight[e], EXPERT_TILE).float()
        return out

    def dequantize(self, expert: int) -> torch.Tensor:
        """Expert `expert`'s weight [rows, cols] in float32."""
        return self.weight[expert].float()


@dataclass
class ExpertBlocks:
    """A 3-D GGUF tensor [E, rows, cols] kept as its block bytes: `data` [E, rows, bytes per row] uint8, a numpy
    view of the file's mmap (no copy) or a tensor."""

    qtype: str
    data: np.ndarray | torch.Tensor
    cols: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data.shape[0], self.data.shape[1], self.cols)

    def address(self) -> int:
        """The address of the first expert's first byte."""
        if isinstance(self.data, torch.Tensor):
            return self.data.data_ptr()
        return self.data.ctypes.data

    def expert(self, e: int) -> torch.Tensor:
        """Expert e's block bytes [rows, bytes per row] as a tensor (a view: read-only when from the mmap)."""
        part = self.data[e]
        if isinstance(part, torch.Tensor):
            return part
        with warnings.catch_warnings():  # a view of the read-only mmap; nothing writes to it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(part)


def repacked_experts(part: ExpertBlocks, lib: ctypes.CDLL) -> ExpertBlocks:
    """`part` with each expert's rows in the layout the kernels read fastest (what cpu_native.repacked does for a
    matrix: the _X8 bands for rows % 8 == 0, else Q4_0 / Q4_1's _R8 rows; same size), a new tensor; `part` itself
    where its format has no such layout. When `part` was a view of the file's mmap,
    this process's mapping of those pages is released after the copy (they stay in the page cache), so the file's
    expert bytes do not stay resident beside their copy."""
    experts, rows, row_bytes = part.data.shape
    if part.qtype not in GGUF_QTYPES:
        return part
    fmt = FORMATS[part.qtype][0]
    twin_id = lib.qmm_repacked_format(fmt, rows)
    twin = next((name for name, spec in FORMATS.items() if spec[0] == twin_id), None)
    if twin is None:
        return part
    out = torch.empty((experts, rows, row_bytes), dtype=torch.uint8)
    src, expert_bytes = part.address(), rows * row_bytes
    for e in range(experts):  # expert by expert: a band of 8 rows never spans two experts
        lib.qmm_repack(fmt, src + e * expert_bytes, row_bytes, rows, part.cols, out[e].data_ptr())
    if isinstance(part.data, np.ndarray):  # a view of the file's mmap: the copy replaces it, unmap its pages
        release_pages(part.data)
    return ExpertBlocks(twin, out, part.cols)


class BlockExperts:
    """One projection of every expert in GGUF block formats on the native CPU kernels: parts stacked along the
    output rows (e.g. the gate and up tensors, which may differ in format), each [E, rows, bytes per row]. Only
    the active experts' rows are read: in one native call (qmm_moe_matmul, threads over experts and rows), or with
    `one_call` False one qmm_matmul per active expert and part. With `repack` the
    experts are copied into the kernels' faster layout (`repacked_experts`), else they stay where they are (a
    GGUF's memory map)."""

    one_call = True

    def __init__(self, parts: list[ExpertBlocks], lib: ctypes.CDLL | None = None, repack: bool = False):
        if len({p.cols for p in parts}) != 1 or len({p.data.shape[0] for p in parts}) != 1:
            raise ValueError("expert parts disagree on experts or columns")
        for p in parts:
            if not native_format(p.qtype, p.cols):
                raise ValueError(f"{p.qtype} with {p.cols} columns is not a native format")
        self.lib = lib or cpu_native.library()
        if self.lib is None:
            raise RuntimeError("native CPU kernels are not available")
        self.parts = [repacked_experts(p, self.lib) for p in parts] if repack else parts
        parts = self.parts
        self.num_experts = parts[0].data.shape[0]
        self.in_features = parts[0].cols
        self.out_features = sum(p.data.shape[1] for p in parts)
        # per part: format id, address, bytes per expert, bytes per row, rows
        self._kernel = [(FORMATS[p.qtype][0], p.address(), p.data.shape[1] * p.data.shape[2], p.data.shape[2],
                         p.data.shape[1]) for p in parts]
        # the same, as the arrays qmm_moe_matmul takes
        self._fmt = torch.tensor([k[0] for k in self._kernel], dtype=torch.int32)
        self._w = torch.tensor([k[1] for k in self._kernel], dtype=torch.int64)
        self._expert_bytes = torch.tensor([k[2] for k in self._kernel], dtype=torch.int64)
        self._row_bytes = torch.tensor([k[3] for k in self._kernel], dtype=torch.int64)
        self._rows = torch.tensor([k[4] for k in self._kernel], dtype=torch.int32)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.num_experts, self.out_features, self.in_features)

    def grouped(self, x: torch.Tensor, groups: ExpertGroups, gather: bool) -> torch.Tensor:
        """float32 [N, rows]: sorted row i times its expert's weight; its input is x[groups.token[i]] when
        `gather` (each token's activations quantized once), else x[i]."""
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        if x.shape[0] and x.stride(1) != 1:
            x = x.contiguous()
        k = self.in_features
        qa, da, sa = quantize_activations(x, self.lib)
        if gather:
            qa, da, sa = qa[groups.token], da[groups.token], sa[groups.token]
        n_out = self.out_features
        out = torch.empty(groups.rows, n_out, dtype=torch.float32)
        pa, pd, ps, po = qa.data_ptr(), da.data_ptr(), sa.data_ptr(), out.data_ptr()
        if self.one_call:
            if groups.active:
                rc = self.lib.qmm_moe_matmul(len(self._kernel), self._fmt.data_ptr(), self._w.data_ptr(),
                                             self._expert_bytes.data_ptr(), self._row_bytes.data_ptr(),
                                             self._rows.data_ptr(), k, pa, pd, ps, len(groups.active),
                                             groups.active_ids.data_ptr(), groups.starts.data_ptr(), po, n_out)
                if rc == -1:
                    raise MemoryError(f"the grouped expert matmul of {groups.rows} rows could not allocate its tasks")
                if rc != 0:
                    raise ValueError(f"the grouped expert matmul takes at most 4 parts, not {len(self._kernel)}")
            return out
        for e, s, t in groups.active:
            col = 0
            for fmt, base, expert_bytes, row_bytes, rows in self._kernel:
                self.lib.qmm_matmul(fmt, base + e * expert_bytes, row_bytes, rows, k, pa + s * k,
                                    pd + s * (k // 32) * 4, ps + s * (k // 16) * 2, t - s, po + (s * n_out + col) * 4,
                                    n_out)
                col += rows
        return out

    def dequantize(self, expert: int) -> torch.Tensor:
        """Expert `expert`'s weight [rows, cols] in float32 (for tests and references)."""
        pieces = []
        for p in self.parts:
            data = p.expert(expert)
            ids = torch.arange(data.shape[0], dtype=torch.int64)
            out = torch.empty(data.shape[0], p.cols, dtype=torch.float32)
            self.lib.qmm_dequant_rows(FORMATS[p.qtype][0], data.data_ptr(), data.shape[1], p.cols, ids.data_ptr(),
                                      ids.numel(), out.data_ptr())
            pieces.append(out)
        return torch.cat(pieces)


Experts = DenseExperts | BlockExperts
