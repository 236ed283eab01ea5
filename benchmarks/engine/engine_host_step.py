"""Host time per decode step of the engine (everything but the model's forward), this checkout against another git
revision, side by side.

The model is a random tiny Llama (benchmarks/configs/tiny-llama.json widened to a 49152-token vocabulary and a
16k context) whose `forward` and `logits` are replaced by stubs that return zeros of the right shape, so a step's
time is the engine's own work: scheduling, KV block bookkeeping, building the batch inputs, sampling (greedy over
the vocabulary), detokenizing and stop checks. For every batch size B and context C, B prompts of C tokens are
stepped to decoding (prefill excluded), then each of N - 1 decode steps is timed with its text work (detokenize,
stop strings: inside the step now, by the caller before); the median step is reported. Each side runs in its own process; sides alternate A/B/A/B for `--rounds` rounds; medians are printed.

    python benchmarks/engine/engine_host_step.py --against 4286945[,REV2...] [--rounds 3] [--batch 1,8,32] [--context 256,8192]
    python benchmarks/engine/engine_host_step.py --side    # this checkout only: prints JSON
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny-llama.json"


def stub_model(lm) -> None:
    """Replace the forward and the logits with zeros of their shapes (the host's work stays)."""
    import torch

    hidden, vocab = lm.config.hidden_size, lm.config.vocab_size
    zeros = {}  # made once per shape: filling fresh pages is not the engine's cost

    def cached(rows: int, width: int) -> torch.Tensor:
        if (rows, width) not in zeros:
            zeros[rows, width] = torch.zeros(rows, width)
        return zeros[rows, width]

    lm.model.forward = lambda ids, positions, attn, prompt_rows=None: cached(ids.shape[0], hidden)
    lm.model.logits = lambda h: cached(h.shape[0], vocab)


def stepper(llm, prompts: list[list[int]], params):
    """A function running one engine step with its text work (detokenize, stop strings) done, as the revision
    under test does it; returns how many requests got tokens."""
    core = llm.engine
    try:
        from edgeserve.engine.delivery import Outbox
    except ImportError:  # before the Outbox: the caller turned the core's token outputs into text
        from edgeserve.engine.sched.output_processor import OutputProcessor

        procs = {core.add_request(p, params): None for p in prompts}
        for rid, p in zip(list(procs), prompts):
            procs[rid] = OutputProcessor(rid, p, params, llm.lm.tokenizer)

        def step() -> int:
            outs = core.step()
            for out in outs:
                procs[out.request_id].process(out)
            return sum(1 for o in outs if o.token_ids)
        return step
    outbox = Outbox()
    for p in prompts:
        outbox.open(core.add_request(p, params), lambda delta: None)

    def step() -> int:
        outs = core.step()
        outbox.deliver(outs)
        return sum(1 for o in outs if o.token_ids)
    return step


def side(batches: list[int], contexts: list[int], tokens: int, repeats: int) -> dict:
    """Median host ms per decode step for every (batch, context), for the importable edgeserve."""
    import edgeserve
    from edgeserve import LLM, SamplingParams
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    import torch

    torch.set_num_threads(1)  # one thread: on a busy machine the pool's wake-ups, not the work, would dominate
    folder = Path(tempfile.mkdtemp(prefix="host-step-"))
    config = json.loads(TINY.read_text())
    config.update(vocab_size=49152, max_position_embeddings=16384)
    (folder / "config.json").write_text(json.dumps(config))
    lm = load_model(resolve(str(folder)), dtype="float32", device="cpu", load_format="dummy")
    stub_model(lm)
    result: dict = {"edgeserve": edgeserve.__file__, "step_ms": {}}
    params = SamplingParams(temperature=0.0, max_tokens=tokens + 2, ignore_eos=True)
    for c in contexts:
        for b in batches:
            times = []
            for _ in range(repeats):
                llm = LLM.from_model(lm, kv_cache_gb=b * (c + tokens + 32) * 1024 / 2**30, max_num_seqs=b,
                                     max_num_batched_tokens=max(8192, c), max_model_len=c + tokens + 32,
                                     enable_prefix_caching=False)
                prompts = [[(7 * i + 13 * j) % 40000 + 100 for j in range(c)] for i in range(b)]
                step = stepper(llm, prompts, params)
                while step() < b:  # prefill until every request decodes
                    pass
                for _ in range(tokens - 1):
                    start = time.perf_counter()
                    step()
                    times.append((time.perf_counter() - start) * 1e3)
                while llm.engine.has_work():
                    step()
            result["step_ms"][f"{b}x{c}"] = statistics.median(times)
    return result


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from decode_step import against_this_checkout, alternation_parser

    ap = alternation_parser(__doc__.splitlines()[0],
                            "git revisions to compare with, comma-separated; this checkout is the last side",
                            rounds=3, tokens=24, batch="1,8,32", repeats_help="generations per point in one process")
    ap.add_argument("--context", default="256,8192")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    contexts = [int(c) for c in args.context.split(",")]
    if args.side or not args.against:
        print(json.dumps(side(batches, contexts, args.tokens, args.repeats)))
        return
    cmd = [sys.executable, __file__, "--side", "--tokens", str(args.tokens), "--batch", args.batch,
           "--context", args.context, "--repeats", str(args.repeats)]
    results = against_this_checkout(args.against.split(","), cmd, args.rounds,
                                    lambda r, name, out: print(f"round {r} {name}: {out['step_ms']}", flush=True))
    names = list(results)
    print("median host ms per decode step; ratio = this checkout / first side")
    print(f"{'batch x context':>16} " + " ".join(f"{n:>14}" for n in names) + "   ratio")
    for key in results[names[0]][0]["step_ms"]:
        med = [statistics.median(x["step_ms"][key] for x in results[n]) for n in names]
        print(f"{key:>16} " + " ".join(f"{m:>11.3f} ms" for m in med) + f"   {med[-1] / med[0]:.2f}")


if __name__ == "__main__":
    main()
