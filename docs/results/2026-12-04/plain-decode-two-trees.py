import sys, time, statistics
sys.path.insert(0, "/work/main/benchmarks/engine")
from mtp_oracle import VOCAB, plain_run, write_model
import edgeserve; print(edgeserve.__file__, file=sys.stderr)
from edgeserve.models.load import load_model
from edgeserve.registry import resolve
shape, layers = sys.argv[1], int(sys.argv[2]) or None
lm = load_model(resolve(str(write_model(shape, "Q4_K_M", layers, VOCAB))))
opts = dict(kv_cache_gb=0.25, max_num_seqs=1, enable_prefix_caching=False)
prompt, params, plain, reference = plain_run(lm, 256, opts)
r = []
for _ in range(3):
    t = time.perf_counter(); c = time.process_time(); out = plain.generate([prompt], params)[0].outputs[0].token_ids
    r.append((len(out) / (time.perf_counter() - t), len(out) / (time.process_time() - c)))
print(sys.argv[3], "wall", [round(a, 1) for a, _ in r], "cpu", [round(b, 1) for _, b in r])
