import sys, time, torch
if sys.argv[2] == "1": torch.set_flush_denormal(True)
from edgeserve import LLM, SamplingParams
llm = LLM(sys.argv[1], kv_cache_gb=0.2)
p = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
llm.generate(["hello there"], p)
r = []
for _ in range(3):
    c = time.process_time(); out = llm.generate(["hello there, how are"], p)[0].outputs[0].token_ids; r.append(len(out) / (time.process_time() - c))
print("flush", sys.argv[2], [round(x, 2) for x in r])
