import sys, time, statistics, cProfile, pstats
sys.path.insert(0, "/work/main/benchmarks/engine")
from mtp_oracle import VOCAB, oracle_for, plain_run, write_model
from edgeserve import LLM
from edgeserve.engine.spec.backoff import Backoff
from edgeserve.models.load import load_model
from edgeserve.registry import resolve
class Never(Backoff):
    def drafts_now(self, i): return False
    def paused(self, i): return True
lm = load_model(resolve(str(write_model("qwen35moe-35b-a3b", "Q4_K_M", 4, VOCAB))))
opts = dict(kv_cache_gb=0.25, max_num_seqs=1, enable_prefix_caching=False)
prompt, params, plain, reference = plain_run(lm, 256, opts)
llm = LLM.from_model(lm, speculative="mtp", num_speculative_tokens=2, **opts)
llm.engine.spec.backoff = Never(0.5)
sides = {"plain": plain, "never": llm}
cpu = {s: [] for s in sides}
for r in range(int(sys.argv[1])):
    for s, l in sides.items():
        c = time.process_time(); out = l.generate([prompt], params)[0].outputs[0].token_ids; cpu[s].append(time.process_time() - c)
        assert out == reference
for s in sides: print(s, [round(x, 3) for x in cpu[s]], statistics.median(cpu[s]))
if len(sys.argv) > 2:
    for s, l in sides.items():
        p = cProfile.Profile(); p.enable(); l.generate([prompt], params); p.disable()
        print("=====", s); pstats.Stats(p).sort_stats("tottime").print_stats(25)
