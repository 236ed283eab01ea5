"""MTP at forced 70% (even draws), k = 2 / 3: the accepted drafts owed to the next step against replayed at once,
alternating in one process, plus plain; two threads."""
import sys, json, statistics, time
sys.path.insert(0, "/work/main/benchmarks/engine")
from mtp_oracle import VOCAB, oracle_for, plain_run, write_model
from edgeserve import LLM
from edgeserve.models.load import load_model
from edgeserve.registry import resolve
shape = sys.argv[1]; rounds = int(sys.argv[2]); ntok = int(sys.argv[3])
lm = load_model(resolve(str(write_model(shape, "Q4_K_M", None, VOCAB))))
rec = lm.model.native_decoder().recurrent
opts = dict(kv_cache_gb=0.25, max_num_seqs=1, enable_prefix_caching=False)
prompt, params, plain, reference = plain_run(lm, ntok, opts)
sides = {"plain": (plain, None)}
for k in (2, 3):
    for defer in (False, True):
        llm = LLM.from_model(lm, speculative="mtp", num_speculative_tokens=k, **opts)
        llm.engine.spec.mtp.oracle = oracle_for(prompt, reference, 0.7, lm.config.vocab_size)
        llm.engine.spec.backoff = None
        sides[f"k={k} {'owed' if defer else 'replayed'}"] = (llm, defer)
rates = {s: [] for s in sides}
cpu = {s: [] for s in sides}
for r in range(rounds + 1):
    for s, (llm, defer) in sides.items():
        if defer is not None:
            rec.defer = defer
        t, c = time.perf_counter(), time.process_time()
        out = llm.generate([prompt], params)[0].outputs[0].token_ids
        dt, dc = time.perf_counter() - t, time.process_time() - c
        assert out == reference, s
        if r:
            rates[s].append(len(out) / dt)
            cpu[s].append(len(out) / dc)
base = statistics.median(rates["plain"])
cbase = statistics.median(cpu["plain"])
for s, v in rates.items():
    print(json.dumps({"shape": shape, "side": s, "median_tok_s": round(statistics.median(v), 2),
                      "ratio": round(statistics.median(v) / base, 3), "rounds": [round(x, 1) for x in v],
                      "cpu_ratio": round(statistics.median(cpu[s]) / cbase, 3), "cpu_rounds": [round(x, 1) for x in cpu[s]]}))
