"""take_rows (index_select / no copy) against tensor indexing, same process, sides alternating; MTP k=2 at 70%."""
import sys, time, statistics, torch
sys.path.insert(0, "/work/main/benchmarks/engine")
from mtp_oracle import VOCAB, oracle_for, plain_run, write_model
from edgeserve import LLM
from edgeserve.models.load import load_model
from edgeserve.registry import resolve
import edgeserve.engine.core as core
from edgeserve.kernels.transfer import take_rows, to_device
def old_rows(t, rows):
    return t[to_device(rows, torch.long, t.device)]
lm = load_model(resolve(str(write_model(sys.argv[1], "Q4_K_M", None, VOCAB))))
opts = dict(kv_cache_gb=0.25, max_num_seqs=1, enable_prefix_caching=False)
prompt, params, plain, reference = plain_run(lm, 128, opts)
sides = {}
for name in ("indexing", "take_rows"):
    llm = LLM.from_model(lm, speculative="mtp", num_speculative_tokens=2, **opts)
    llm.engine.spec.backoff = None
    sides[name] = llm
rates = {n: [] for n in sides}
for r in range(int(sys.argv[2])):
    for name, llm in (sides.items() if r % 2 == 0 else reversed(sides.items())):
        llm.engine.spec.mtp.oracle = oracle_for(prompt, reference, 0.7, lm.config.vocab_size, seed=r)
        core.take_rows = take_rows if name == "take_rows" else old_rows
        t = time.perf_counter(); out = llm.generate([prompt], params)[0].outputs[0].token_ids; dt = time.perf_counter() - t
        assert out == reference
        rates[name].append(len(out) / dt)
for n, v in rates.items():
    print(n, round(statistics.median(v), 2), [round(x, 1) for x in v])
print("ratio take_rows / indexing", round(statistics.median(rates["take_rows"]) / statistics.median(rates["indexing"]), 3))
