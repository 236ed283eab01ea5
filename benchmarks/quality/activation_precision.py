"""Where a quantized file's served path loses precision against llama.cpp's: the converter-parity case widened as
layer_drift.py makes it (`--outtype q8_0`: the converter's Q8_0 file), loaded three ways by edgeserve:
- reference: `--dtype float32` (the file's blocks dequantized, float32 everywhere: transformers' equal);
- bf16: the served path (the native block kernels, bf16 compute between them; since issue 54's fix a Qwen3.5
  model's normed rows reach its kernels in float32, Qwen35Model.act_dtype);
- f32 activations: the native block kernels (int8 activation blocks, as llama.cpp's Q8_0 dot products) with float32
  between them, as llama.cpp's CPU backend keeps every activation (a float32 KV pool: edgeserve pairs f16 with
  bf16 compute only);
and the bf16 run again with a bf16 KV pool, a small perturbation that shows how far the drift moves by chance.
Prints each one's drift from the reference (mean |logprob diff| over the reference's top 5 at every position of
random prompts), per prompt, and the share of expert choices that differ per MoE layer.

    .venv/bin/python benchmarks/quality/activation_precision.py --case gemma4-26b-a4b --hidden 256 --head-dim 256

`--kept FILE.gguf`: instead, a file beside_llama_server.py kept (`--keep`, with its `.results.pt`: the prompts,
transformers' reference, llama-server's top 5 and the served run's log-probabilities): this tree's served path and
the f32-activations run on the same prompts, beside the saved rows, each against the reference as that script
reports it (no llama-server or transformers run: a few GB less than the script itself).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from converter_parity import load_ours, our_logits  # noqa: E402
from layer_drift import make_gguf, routing_drift  # noqa: E402


@contextlib.contextmanager
def blocks_at_float32():
    """Loads inside keep GGUF blocks on the native kernels at float32 compute (the loaders' rule dequantizes them
    at float32)."""
    from edgeserve.kernels.cpu import native
    from edgeserve.models import llama, moe_weights, weight_loader

    def block_weight(source, names, device, dtype):
        return orig_block(source, names, device, torch.bfloat16 if dtype == torch.float32 else dtype)

    def experts_here(source, device, dtype):
        return orig_experts(source, device, torch.bfloat16 if dtype == torch.float32 else dtype)

    orig_block, orig_experts = native.block_weight, moe_weights.native_experts_here
    weight_loader.block_weight = llama.block_weight = block_weight
    moe_weights.native_experts_here = experts_here
    try:
        yield
    finally:
        weight_loader.block_weight = llama.block_weight = orig_block
        moe_weights.native_experts_here = orig_experts


def drift(model, ref, prompts: list[list[int]], kv: str) -> list[float]:
    """Per prompt: mean |logprob diff| of `model` from `ref` over ref's top 5 at every position (each model on its
    default path)."""
    out = []
    for p in prompts:
        lr = our_logits(ref, p, prompt_len=len(p)).log_softmax(-1)
        lm = our_logits(model, p, kv_cache_dtype=kv, prompt_len=len(p)).log_softmax(-1)
        top = lr.topk(5, dim=-1).indices
        out.append((lm.gather(1, top) - lr.gather(1, top)).abs().mean().item())
    return out


def kept_row(gguf: Path) -> None:
    """beside_llama_server.py's numbers for a kept file: the served run and llama-server as saved, this tree's
    served path and the f32-activations run made now, each against the saved reference over llama-server's top 5."""
    from beside_llama_server import compare

    saved = torch.load(gguf.with_name(gguf.name + ".results.pt"))

    def last_rows(model, kv: str = "auto") -> torch.Tensor:
        return torch.stack([our_logits(model, ids, kv, prompt_len=len(ids))[-1]
                            for ids in saved["prompts"]]).log_softmax(-1)

    served = load_ours(gguf, dtype="auto").model  # this tree's served path, beside the saved one
    now = [(f"served now (this tree, {served.dtype}, f16 KV)", last_rows(served))]
    if served.dtype == torch.bfloat16:
        now.append(("served now, bf16 KV", last_rows(served, "bf16")))
    del served
    with blocks_at_float32():
        f32act = last_rows(load_ours(gguf, dtype="float32").model)
    n = len(saved["prompts"])
    for name, ours in (("served as saved (bf16, f16 KV)", saved["ours"]), ("served as saved, bf16 KV",
                                                                           saved["bf16_kv"]),
                       *now, ("f32 activations, f32 KV", f32act)):
        if ours is None:  # the served run computed in float32 (an F32 file): no bf16 KV run beside it
            continue
        c = compare(saved["llama"], ours, saved["ref"])
        print(f"{gguf.name} {name}: top-1 = llama-server {c['agree']}/{n}, diff from llama-server {c['diff']:.3f}; "
              f"top-1 = ref {c['ours_ref_top1']}/{n}, vs ref {c['ours_ref']:.3f} (llama-server: top-1 = ref "
              f"{c['llama_ref_top1']}/{n}, vs ref {c['llama_ref']:.3f})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="gemma4-26b-a4b")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--outtype", default="q8_0", choices=("q8_0", "bf16"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--work", type=Path, default=Path("/tmp/layer_drift"))
    ap.add_argument("--kept", type=Path, help="a GGUF kept by beside_llama_server.py --keep (see above)")
    a = ap.parse_args(argv)
    if a.kept:
        kept_row(a.kept)
        return 0
    a.work.mkdir(parents=True, exist_ok=True)
    gguf = make_gguf(a.case, a.hidden, a.work, a.head_dim, a.outtype)
    ref = load_ours(gguf, dtype="float32").model
    with blocks_at_float32():
        f32act = load_ours(gguf, dtype="float32").model
    bf16 = load_ours(gguf, dtype="bfloat16").model
    runs = [("bf16, f16 KV (served)", bf16, "auto"), ("bf16, bf16 KV (a perturbation: the noise)", bf16, "bf16"),
            ("f32 activations, f32 KV (llama.cpp's precision)", f32act, "auto")]
    g = torch.Generator().manual_seed(54)
    prompts = [torch.randint(3, 30000, (24,), generator=g).tolist() for _ in range(a.prompts)]
    for name, model, kv in runs:
        d = drift(model, ref, prompts, kv)
        print(f"{name}: {a.prompts} prompts of 24 tokens, mean |logprob diff| from the reference over its top 5 at "
              f"every position: mean {sum(d) / len(d):.4f} (per prompt {' '.join(f'{x:.3f}' for x in d)})")
    for name, model, _ in runs[::2]:
        print(f"routing on the fixed ids, {name} against the reference:")
        routing_drift(model, ref)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
