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
from converter_parity import widened  # noqa: E402
from dequantized_reference import dequantized_reference, drift  # noqa: E402

DEFAULT_CASES = ("qwen3", "qwen3moe", "llama", "gemma3", "qwen35", "qwen35moe-mtp", "gemma4-e2b", "gemma4-26b-a4b",
                 "gpt-oss")
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
