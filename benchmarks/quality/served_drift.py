"""Served-path drift per architecture (issue 54): how far the server's default compute (bf16 on CPU, the fused native
stack, the quantized native matmuls) moves the logits away from transformers' float32 run on the *same* weights.

Each case of the converter-parity harness (tests/converter_cases.py) is built wider and deeper (hidden 256, 4-8
layers), converted by llama.cpp's own convert_hf_to_gguf.py to f32, bf16 and q8_0 GGUFs, and for each file:
- `ref`: transformers' float32 logits with the model's weights replaced by the file's dequantized values (so the
  quantization itself is not counted, only compute precision);
- `f32`: edgeserve on the file at dtype float32 (a check of the weight substitution: float32 noise);
- `served`: edgeserve on the file at its default dtype ("auto": bf16 compute on CPU, the native kernels), with the
  KV pool of each `--kv-cache-dtypes` choice (auto: f16 beside bf16 compute on the CPU).
Reported per file: max and mean over positions of max |logprob diff| over the vocabulary, and top-1 agreement.

Q4_K_M is not measured: there is no float -> Q4_K quantizer here (edgeserve's benchmarks/make_gguf.py writes random
Q4_K blocks, not quantized weights; gguf-py quantizes only BF16 / Q4_0..Q8_0 / MXFP4) and llama-quantize is not
built.

    .venv/bin/python benchmarks/quality/served_drift.py [--cases gpt-oss,qwen35] [--outtypes f32,bf16,q8_0]
        [--kv-cache-dtypes bf16,f16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from converter_cases import BY_NAME  # noqa: E402
from converter_parity import (build_checkpoint, convert, load_ours, our_logits, reference_logits,  # noqa: E402
                              spm_tokenizer_folder, tokenizer_folder)

DEFAULT_CASES = ("qwen3", "qwen3moe", "llama", "gemma3", "qwen35", "qwen35moe-mtp", "gemma4-e2b", "gemma4-26b-a4b",
                 "gpt-oss")
HIDDEN = 256
WIDER = {"intermediate_size": 512, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 256,
         "hidden_size_per_layer_input": 32}


def widened(config_fn):
    """The case's config at hidden 256 (its feed-forwards 2x wider) and 4-8 layers (its layer pattern repeated)."""

    def make(vocab: int):
        cfg = config_fn(vocab)
        text = cfg.get_text_config()
        text.hidden_size = HIDDEN
        for k, v in WIDER.items():
            if getattr(text, k, None):
                setattr(text, k, v)
        reps = max(1, 6 // text.num_hidden_layers)
        text.num_hidden_layers *= reps
        if getattr(text, "layer_types", None):
            text.layer_types = list(text.layer_types) * reps
        return cfg

    return make


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


def run_case(name: str, outtypes: list[str], tokenizers: dict[str, Path], work: Path,
             kv_cache_dtypes: list[str]) -> list[str]:
    """The report rows of one architecture."""
    import copy

    case = replace(BY_NAME[name], config=widened(BY_NAME[name].config))
    folder = work / name
    folder.mkdir()
    model = build_checkpoint(case, tokenizers[case.tokenizer], folder)
    f32 = convert(folder, work / f"{name}.f32.gguf", *case.convert_args, outtype="f32")
    rows = []
    for outtype in outtypes:
        gguf = f32 if outtype == "f32" else convert(folder, work / f"{name}.{outtype}.gguf", *case.convert_args,
                                                     outtype=outtype)
        ref_model, missed = dequantized_reference(copy.deepcopy(model), f32, gguf)
        ref = reference_logits(ref_model)
        exact = drift(our_logits(load_ours(gguf).model), ref)
        served_model = load_ours(gguf, dtype="auto").model
        for kv in kv_cache_dtypes:
            served = drift(our_logits(served_model, kv_cache_dtype=kv), ref)
            n = ref.shape[0]
            rows.append(f"| {name} | {outtype} | {exact[0]:.1e} | {served[0]:.3f} | {served[1]:.4f} | {served[2]}/{n} "
                        f"| {served_model.dtype}, KV {kv} |" + (f" {missed} rows not substituted |" if missed else ""))
            print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES), help="converter_cases names, comma-separated")
    ap.add_argument("--outtypes", default="f32,bf16,q8_0")
    ap.add_argument("--kv-cache-dtypes", default="auto",
                    help="--kv-cache-dtype choices to serve with, comma-separated (e.g. bf16,f16: before and after)")
    args = ap.parse_args(argv)
    from edgeserve.registry import DEFAULT_MODEL, pull

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "tok-bpe").mkdir()
        (work / "tok-spm").mkdir()
        tokenizers = {"bpe": tokenizer_folder(pull(DEFAULT_MODEL, progress=False), work / "tok-bpe"),
                      "spm": spm_tokenizer_folder(work / "tok-spm")}
        print("| arch | file | ours f32 max | served max | served mean | served top-1 | served dtype |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for name in args.cases.split(","):
            run_case(name, args.outtypes.split(","), tokenizers, work, args.kv_cache_dtypes.split(","))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
