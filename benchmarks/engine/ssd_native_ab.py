"""The Mamba-2 layers' recurrence native (kernels/cpu/src/ssd.c through kernels.dispatch.ssd_scan) against the torch
twin (kernels.torch.mamba2.ssd_scan), in one process on one loaded model, alternating A/B per round: the seconds of a
greedy generation of `--tokens` tokens for `--batch` short prompts (decode-dominated), and whether the two sides
generated the same ids.

    python benchmarks/engine/ssd_native_ab.py --model GGUF [--batch 1,8] [--tokens 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json

from edgeserve import LLM, SamplingParams
from edgeserve.bench.timing import alternate
from edgeserve.kernels.torch import mamba2 as torch_mamba2
from edgeserve.models.archs.nemotron_h import model as mamba2_layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a nemotron_h / granitehybrid / falcon-h1 GGUF")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(args.model, kv_cache_gb=0.2)
    native = mamba2_layers.ssd_scan
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    for batch in (int(b) for b in args.batch.split(",")):
        prompts = [llm.tokenizer.encode(f"Story {i}: a dragon and a knight.") for i in range(batch)]
        ids: dict[str, list] = {}

        def side(name: str, scan):
            def run() -> None:
                mamba2_layers.ssd_scan = scan
                ids[name] = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
            return run

        result = alternate({"torch": side("torch", torch_mamba2.ssd_scan), "native": side("native", native)},
                           rounds=args.rounds)
        mamba2_layers.ssd_scan = native
        print(json.dumps({"batch": batch, "tokens": args.tokens, "torch_ms": round(result.median_ms("torch")),
                          "native_ms": round(result.median_ms("native")),
                          "native_over_torch": round(result.ratio("native", "torch"), 3),
                          "same_ids": ids["torch"] == ids["native"]}), flush=True)


if __name__ == "__main__":
    main()
