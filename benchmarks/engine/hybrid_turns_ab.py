"""Cold TTFT of a 1,000-token prompt and the second turn of a two-turn text chat on a hybrid (or any) GGUF, in one
process, wall and process CPU time; run it under two package trees (PYTHONPATH) alternating for a before/after.

    PYTHONPATH=/tmp/base/site OMP_NUM_THREADS=2 python benchmarks/engine/hybrid_turns_ab.py MODEL.gguf ROUNDS

Turn 1: `User: ` + 990 random words + `\\nAssistant:`, 32 tokens out; turn 2: turn 1 + its reply + 55 words, one
token out (as benchmarks/serve/multiturn_ttft.py builds them). Prints one JSON line; `turn2_cached` is [cached tokens,
prompt tokens] of each second turn."""
import argparse
import json
import random
import time

import edgeserve
from edgeserve import LLM, SamplingParams

WORDS = ("the of and to in is was for on that with as by at from his her an are were which this be has had "
         "model layer state token cache memory server prompt turn reply value weight matrix vector head time").split()


def timed(f):
    w, c = time.perf_counter(), time.process_time()
    r = f()
    return r, (time.perf_counter() - w) * 1e3, (time.process_time() - c) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a GGUF path or catalog name")
    ap.add_argument("rounds", type=int)
    args = ap.parse_args()
    llm = LLM(args.model, kv_cache_gb=0.3)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([[1, 2, 3]], one)  # warm-up
    res: dict = {"cold_ms": [], "cold_cpu_ms": [], "turn2_ms": [], "turn2_cpu_ms": [], "turn2_cached": []}
    for r in range(args.rounds):
        rng = random.Random(2000 + r)
        ids = [rng.randrange(1000, 100000) for _ in range(1000)]
        _, w, c = timed(lambda: llm.generate([ids], one))
        res["cold_ms"].append(w)
        res["cold_cpu_ms"].append(c)
        p1 = "User: " + " ".join(rng.choice(WORDS) for _ in range(990)) + "\nAssistant:"
        new = "\nUser: " + " ".join(rng.choice(WORDS) for _ in range(55)) + "\nAssistant:"
        t1 = llm.generate([p1], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
        r2, w, c = timed(lambda: llm.generate([p1 + t1.text + new], one)[0])
        res["turn2_ms"].append(w)
        res["turn2_cpu_ms"].append(c)
        res["turn2_cached"].append([r2.num_cached_tokens, len(r2.prompt_token_ids)])
    print(json.dumps({"edgeserve": edgeserve.__file__, **res}))


if __name__ == "__main__":
    main()
