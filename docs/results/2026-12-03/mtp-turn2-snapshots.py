"""A two-turn chat on a Qwen3.5 shape with MTP (k = 2, forced 70% acceptance, even draws): turn 1 a 200-token prompt
and a 256-token answer, turn 2 turn 1 + its answer + 50 tokens, one token out. Prints the tokens turn 2 resumed
from (prefix-cache state snapshot) and its wall / CPU time, median over rounds (a fresh engine each round)."""
import sys, json, random, statistics, time
sys.path.insert(0, "/work/main/benchmarks/engine")
from mtp_oracle import VOCAB, oracle_for, write_model
import edgeserve
from edgeserve import LLM, SamplingParams
from edgeserve.models.load import load_model
from edgeserve.registry import resolve
rounds = int(sys.argv[1])
lm = load_model(resolve(str(write_model("qwen35-0.8b", "Q4_K_M", None, VOCAB))))
rnd = random.Random(3)
p1 = [rnd.randrange(1000, 20000) for _ in range(200)]
extra = [rnd.randrange(1000, 20000) for _ in range(50)]
a1 = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
opts = dict(kv_cache_gb=0.5, max_num_seqs=1)
ref = LLM.from_model(lm, speculative="off", **opts).generate([p1], a1)[0].outputs[0].token_ids
walls, cpus, cached = [], [], []
for r in range(rounds):
    llm = LLM.from_model(lm, speculative="mtp", num_speculative_tokens=2, **opts)
    llm.engine.spec.backoff = None
    llm.engine.spec.mtp.oracle = oracle_for(p1, ref, 0.7, lm.config.vocab_size)
    out = llm.generate([p1], a1)[0].outputs[0].token_ids
    assert out == ref
    before = llm.engine.states.counters.prompt_tokens_from_states
    w, c = time.perf_counter(), time.process_time()
    llm.generate([p1 + out + extra], one)
    walls.append((time.perf_counter() - w) * 1e3); cpus.append((time.process_time() - c) * 1e3)
    cached.append(llm.engine.states.counters.prompt_tokens_from_states - before)
print(json.dumps({"tree": edgeserve.__file__, "turn2_prompt": len(p1) + 256 + 50, "turn2_from_states": cached,
                  "turn2_wall_ms": round(statistics.median(walls), 1), "turn2_cpu_ms": round(statistics.median(cpus), 1),
                  "walls": [round(x) for x in walls]}))
