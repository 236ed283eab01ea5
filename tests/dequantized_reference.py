"""Transformers run on a GGUF's own (dequantized) weights: the reference that counts compute precision, not the
quantization (issue 54). Shared by the quantized-drift tests (tests/models/test_quantized_drift.py) and the
served-drift / beside-llama-server benchmarks."""

from __future__ import annotations

from pathlib import Path

import torch


def _row_key(row: torch.Tensor) -> int:
    return hash(row.numpy().tobytes())


def _file_rows(exact, quant, skip: tuple[str, ...]) -> tuple[dict[int, tuple[str, int]], dict[int, tuple[str, int]]]:
    """(name, row) of every row the quantization changed, by the hash of its exact float32 values and of its sorted
    values (hashes, not the rows: the maps stay small beside a model of several GB)."""
    by_row: dict[int, tuple[str, int]] = {}
    by_sorted: dict[int, tuple[str, int]] = {}
    for name in quant.tensor_names():
        if name.startswith(skip):
            continue
        a, b = exact.load_tensor(name), quant.load_tensor(name)
        if torch.equal(a, b):
            continue
        rows = a.reshape(-1, a.shape[-1])
        for i, (row, values) in enumerate(zip(rows, rows.sort(-1).values)):
            by_row[_row_key(row)] = (name, i)
            by_sorted[_row_key(values)] = (name, i)
    return by_row, by_sorted


def dequantized_reference(model, f32_gguf: Path, gguf: Path, skip: tuple[str, ...] = ()
                          ) -> tuple[torch.nn.Module, int]:
    """`model` with each weight row replaced by the file's dequantized row, rows found by their exact float32 values
    in the converter's f32 file (so the converter's renames, row permutations and splits need no mapping; a row
    whose columns the converter permuted, as Qwen3.5's V heads in out_proj, is found by its sorted values and
    takes the same permutation); tensors whose names start with one of `skip` are left out (an MTP block the model
    lacks); returns the model and how many changed rows of the file were not found in it."""
    from edgeserve.loaders.gguf_file import GGUFFile

    exact, quant = GGUFFile(f32_gguf), GGUFFile(gguf)
    by_row, by_sorted = _file_rows(exact, quant, skip)
    hits: dict[str, list[tuple[torch.Tensor, int, torch.Tensor | None]]] = {}
    for p in model.parameters():
        rows = p.data.reshape(-1, p.shape[-1]) if p.dim() else p.data.reshape(1, 1)
        for row in rows:
            hit, order = by_row.get(_row_key(row)), None
            if hit is None:
                values, order = row.sort()
                hit = by_sorted.get(_row_key(values))
            if hit is not None:
                hits.setdefault(hit[0], []).append((row, hit[1], order))
    found = 0
    with torch.no_grad():
        for name, rows in hits.items():
            b = quant.load_tensor(name)
            b = b.reshape(-1, b.shape[-1])
            a = exact.load_tensor(name).reshape(b.shape) if any(o is not None for *_, o in rows) else None
            for row, i, order in rows:
                if order is None:
                    row.copy_(b[i])
                else:  # the model row's k-th smallest value takes the file row's k-th smallest value's place
                    row[order] = b[i][a[i].sort().indices]
                found += 1
    return model, len(by_row) - found


def drift(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, int]:
    """(max, mean) over positions of the max |logprob diff| over the vocabulary, and top-1 agreements."""
    d = (ours.log_softmax(-1) - ref.log_softmax(-1)).abs().amax(-1)
    return d.max().item(), d.mean().item(), int((ours.argmax(-1) == ref.argmax(-1)).sum())
