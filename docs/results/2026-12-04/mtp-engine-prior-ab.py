"""MTP with the back-off on, at forced acceptance: a new request's prior from the engine's earlier requests (the new
Backoff) against the fixed per-request prior of 1.2 of 2 drafts (the old one), alternating in one process, plus plain.
Each side is one engine across rounds, as a server's requests are (round 0 warms up and is not counted).
Usage: python mtp-engine-prior-ab.py SHAPE LAYERS ROUNDS TOKENS ACCEPT[,ACCEPT] K[,K]"""
import json, statistics, sys, time

sys.path.insert(0, "/work/main/benchmarks/engine")
from mtp_oracle import VOCAB, oracle_for, plain_run, write_model

from edgeserve import LLM
from edgeserve.engine.spec.backoff import Backoff, _Request
from edgeserve.models.load import load_model
from edgeserve.registry import resolve


class PerRequestPrior(Backoff):
    """The back-off before the engine-wide prior: every new request starts at 1.2 of 2 drafts, drafting."""

    def _request(self, request_id):
        return self._requests.setdefault(request_id, _Request())


shape, layers, rounds, ntok = sys.argv[1], int(sys.argv[2]) or None, int(sys.argv[3]), int(sys.argv[4])
accepts, ks = [float(x) for x in sys.argv[5].split(",")], [int(x) for x in sys.argv[6].split(",")]
lm = load_model(resolve(str(write_model(shape, "Q4_K_M", layers, VOCAB))))
opts = dict(kv_cache_gb=0.25, max_num_seqs=1, enable_prefix_caching=False)
prompt, params, plain, reference = plain_run(lm, ntok, opts)
sides = {"plain": plain}
for k in ks:
    for acc in accepts:
        for name, cls in (("per-request prior", PerRequestPrior), ("engine prior", Backoff)):
            llm = LLM.from_model(lm, speculative="mtp", num_speculative_tokens=k, **opts)
            llm.engine.spec.mtp.oracle = oracle_for(prompt, reference, acc, lm.config.vocab_size)
            old = llm.engine.spec.backoff
            llm.engine.spec.backoff = cls(old.threshold)
            sides[f"k={k} a={acc:.0%} {name}"] = llm
rates = {s: [] for s in sides}
cpu = {s: [] for s in sides}
drafted = {s: [] for s in sides}
for r in range(rounds + 1):
    for s, llm in sides.items():
        before = llm.engine.stats()
        t, c = time.perf_counter(), time.process_time()
        out = llm.generate([prompt], params)[0].outputs[0].token_ids
        dt, dc = time.perf_counter() - t, time.process_time() - c
        assert out == reference, s
        if r:
            rates[s].append(len(out) / dt)
            cpu[s].append(len(out) / dc)
            drafted[s].append(llm.engine.stats().spec_verifications - before.spec_verifications)
base, cbase = statistics.median(rates["plain"]), statistics.median(cpu["plain"])
for s, v in rates.items():
    print(json.dumps({"shape": shape, "layers": layers, "side": s, "median_tok_s": round(statistics.median(v), 2),
                      "ratio": round(statistics.median(v) / base, 3), "rounds": [round(x, 1) for x in v],
                      "cpu_ratio": round(statistics.median(cpu[s]) / cbase, 3),
                      "cpu_rounds": [round(x, 1) for x in cpu[s]], "drafting_steps": drafted[s]}))
