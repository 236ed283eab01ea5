"""Where the served path's drift comes from on one GGUF (issue 54): edgeserve's float32 run on the file is the
reference, and each variant rounds one thing the served path rounds, everything else float32:

- `served`: the default dtype (bf16 compute on CPU, the fused native stack, the quantized native matmuls);
- `KV+qkv in bf16 / f16`: the float32 model with q, k, v and the KV pool in bf16 (as served) or f16 (llama.cpp's
  default KV cache type);
- `q / k / v bf16 only`: one of them rounded to bf16 after its projection, the pool float32.

    .venv/bin/python benchmarks/quality/attention_precision.py MODEL.gguf

Reported: max and mean over positions of max |logprob diff| over the vocabulary, top-1 agreement and the logits'
relative error (scale-free: random models have large logits, so logprob differences grow with their scale).
Works for models whose per-op path projects q, k, v through `project_qkv` (Llama family, gpt-oss).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from converter_parity import load_ours, our_logits  # noqa: E402


def drift(ours: torch.Tensor, ref: torch.Tensor) -> str:
    """The report line's numbers for logits `ours` against `ref`."""
    d = (ours.log_softmax(-1) - ref.log_softmax(-1)).abs().amax(-1)
    top1 = int((ours.argmax(-1) == ref.argmax(-1)).sum())
    rel = ((ours - ref).norm() / ref.norm()).item()
    return f"max {d.max():.3f} mean {d.mean():.4f} top-1 {top1}/{len(d)} logit rel err {rel:.2e}"


def variant(path: str, round_qkv, pool_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Logits of the float32 per-op model with `round_qkv` applied to (q, k, v) after the projections and the KV
    pool in `pool_dtype` (float32 when None)."""
    import edgeserve.engine.cache.kv_cache as kv_cache
    import edgeserve.models.archs.gpt_oss.model as gpt_oss
    import edgeserve.models.llama as llama

    pool, linears = kv_cache.KVPool, (gpt_oss.linear, llama.linear)
    model = load_ours(path).model
    model._native = None
    project = model.project_qkv
    model.project_qkv = lambda *args: round_qkv(*project(*args))
    try:
        if pool_dtype is not None:
            kv_cache.KVPool = lambda c, b, bs, _d, **kw: pool(c, b, bs, pool_dtype, **kw)
            # the attention output comes back in the pool's dtype; o_proj's weights are float32
            gpt_oss.linear = lambda x, w, b=None, r=None: linears[0](x.float(), w, None if b is None else b.float(), r)
            llama.linear = lambda x, w, b=None, r=None: linears[1](x.float(), w, None if b is None else b.float(), r)
        return our_logits(model).float()
    finally:
        kv_cache.KVPool, (gpt_oss.linear, llama.linear) = pool, linears


def main(path: str) -> int:
    ref = our_logits(load_ours(path).model)
    print("served:", drift(our_logits(load_ours(path, dtype="auto").model), ref))
    for dt in (torch.bfloat16, torch.float16):
        print(f"KV+qkv in {dt}:", drift(variant(path, lambda q, k, v, dt=dt: (q.to(dt), k.to(dt), v.to(dt)), dt), ref))
    r = lambda t: t.bfloat16().float()  # noqa: E731
    for name, f in (("q", lambda q, k, v: (r(q), k, v)), ("k", lambda q, k, v: (q, r(k), v)),
                    ("v", lambda q, k, v: (q, k, r(v)))):
        print(f"{name} bf16 only:", drift(variant(path, f), ref))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: attention_precision.py MODEL.gguf")
    raise SystemExit(main(sys.argv[1]))
