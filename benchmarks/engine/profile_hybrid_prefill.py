"""Where a Qwen3.5 prefill's time goes: process CPU time per section (the model's functions wrapped with timers),
one thread by default, best of N runs of a fresh T-token prompt.

    python benchmarks/engine/profile_hybrid_prefill.py MODEL.gguf T [RUNS]"""
import collections
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("EDGESERVE_THREADS", "1")

import edgeserve.kernels.dispatch as D  # noqa: E402
import edgeserve.kernels.torch.gated_delta as G  # noqa: E402
import edgeserve.models.qwen35 as Q  # noqa: E402
from edgeserve import LLM, SamplingParams  # noqa: E402

acc: collections.Counter = collections.Counter()


def wrap(mod, name: str, label: str | None = None) -> None:
    f = getattr(mod, name)

    def timed(*a, **k):
        t = time.process_time()
        r = f(*a, **k)
        acc[label or name] += time.process_time() - t
        return r

    setattr(mod, name, timed)


for name in ("linear", "add_rms_norm", "rope_write_kv", "sigmoid_gate", "head_rms_norm"):
    wrap(Q, name)
wrap(D, "causal_conv1d_silu", "conv")
wrap(D, "gated_delta_rule", "rule")
wrap(D, "gated_rms_norm", "gated_norm")
wrap(G, "delta_gates", "gates")
for name, label in (("_delta_net", "delta_layers"), ("_attention", "attention_layers"), ("mlp", "mlp"),
                    ("forward", "forward")):
    wrap(Q.Qwen35Model, name, label)


def main() -> None:
    llm = LLM(sys.argv[1], kv_cache_gb=0.3)
    n = int(sys.argv[2])
    ids = [(llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. ") * (n // 8 + 1))[:n]]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(ids, params)
    best = None
    for _ in range(int(sys.argv[3]) if len(sys.argv) > 3 else 3):
        ids[0][0] += 1
        acc.clear()
        t = time.process_time()
        llm.generate(ids, params)
        cpu = time.process_time() - t
        if best is None or cpu < best[0]:
            best = (cpu, dict(acc))
    print(f"{n} tokens, CPU {best[0] * 1e3:.1f} ms")
    for k, v in sorted(best[1].items(), key=lambda kv: -kv[1]):
        print(f"  {k:18s} {v * 1e3:9.1f} ms")


if __name__ == "__main__":
    main()
