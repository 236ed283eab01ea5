"""Probe: the decode forward cut into per-layer segments between the paged attention calls (o_proj, norms, MLP, next
layer's QKV and RoPE); each segment kind compiled once (weights are arguments), KV write and attention eager.
Checks exactness against the engine's eager forward, then times eager vs segmented steps alternately.

    python benchmarks/compile_probes/segmented.py compile   # or: eager (same segmentation, no compile)
"""
import sys, time, os, statistics, torch, torch.nn.functional as F
import torch._inductor.config as icfg
icfg.emulate_precision_casts = True
from edgeserve.models.load import load_model
from edgeserve.registry import resolve
from edgeserve.engine.kv_cache import KVPool, PagedKVAttention
from edgeserve.kernels.paged_attention import AttentionMetadata, paged_attention, write_kv
from edgeserve.kernels.dispatch import linear, add_rms_norm, rms_norm, silu_and_mul
from edgeserve.kernels.rope import apply_rope
torch.manual_seed(0)
lm = load_model(resolve("smollm2-135m"))
model, cfg = lm.model, lm.config
BS = 16
pool = KVPool(cfg, 512, BS, model.dtype)
pool.k.normal_(); pool.v.normal_()
c = cfg; eps = c.rms_norm_eps; nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim

def qkv_rope(h, layer, cos, sin):
    t = h.shape[0]
    qkv = linear(h, layer.qkv, layer.qkv_bias)
    q = qkv[:, : c.q_size].view(t, nh, hd)
    k = qkv[:, c.q_size: c.q_size + c.kv_size].view(t, nkv, hd)
    v = qkv[:, c.q_size + c.kv_size:].view(t, nkv, hd)
    qk = apply_rope(torch.cat([q, k], dim=1), cos, sin)
    return qk[:, :nh].to(model.dtype), qk[:, nh:].to(model.dtype), v

def seg_first(ids, positions, layer):
    x = model.embed.rows(ids)
    cos, sin = model.cos[positions], model.sin[positions]
    h = rms_norm(x, layer.input_norm, eps).to(model.dtype)
    return (x, cos, sin) + qkv_rope(h, layer, cos, sin)

def seg_mid(o, x, layer, nxt, cos, sin):
    h, x = add_rms_norm(linear(o, layer.o_proj), x, layer.post_norm, eps, model.dtype)
    y = linear(silu_and_mul(linear(h, layer.gate_up)), layer.down)
    h, x = add_rms_norm(y, x, nxt.input_norm, eps, model.dtype)
    return (x,) + qkv_rope(h, nxt, cos, sin)

def seg_last(o, x, layer):
    h, x = add_rms_norm(linear(o, layer.o_proj), x, layer.post_norm, eps, model.dtype)
    y = linear(silu_and_mul(linear(h, layer.gate_up)), layer.down)
    h, x = add_rms_norm(y, x, model.norm, eps, model.dtype)
    return linear(h, model.lm_head).float()

MODE = sys.argv[1]
if MODE == "compile":
    cf, cm, cl = torch.compile(seg_first), torch.compile(seg_mid), torch.compile(seg_last)
else:
    cf, cm, cl = seg_first, seg_mid, seg_last

def decode(ids, pos, meta):
    with torch.no_grad():
        L = model.layers
        x, cos, sin, q, k, v = cf(ids, pos, L[0])
        for i in range(len(L)):
            write_kv(pool.k[i], pool.v[i], k, v, meta.slot_mapping)
            o = paged_attention(q, pool.k[i], pool.v[i], meta).reshape(q.shape[0], -1)
            if i + 1 < len(L):
                x, q, k, v = cm(o, x, L[i], L[i + 1], cos, sin)
            else:
                return cl(o, x, L[i])

def make_step(lens):
    tables = [list(range(i * 64, i * 64 + -(-L // BS))) for i, L in enumerate(lens)]
    slots = [t[(L - 1) // BS] * BS + (L - 1) % BS for t, L in zip(tables, lens)]
    ids = torch.randint(0, cfg.vocab_size, (len(lens),))
    pos = torch.tensor([L - 1 for L in lens])
    return ids, pos, (lens, tables, slots)

def meta_of(m):
    lens, tables, slots = m
    return AttentionMetadata.build([1] * len(lens), lens, tables, slots)

def eager(ids, pos, m):
    with torch.inference_mode():
        return model.logits(model.forward(ids, pos, PagedKVAttention(pool, meta_of(m))))

for lens in ([37], [100], [5, 64, 200], [40, 41, 42, 300, 7], [9, 9]):
    ids, pos, m = make_step(lens)
    k0, v0 = pool.k.clone(), pool.v.clone()
    a = eager(ids, pos, m)
    ka, va = pool.k.clone(), pool.v.clone()
    pool.k.copy_(k0); pool.v.copy_(v0)
    t = time.time()
    b = decode(ids, pos, meta_of(m))
    print(lens, "first call s", round(time.time() - t, 1), "logits equal", torch.equal(a, b), (a - b).abs().max().item(),
          "kv equal", torch.equal(ka, pool.k), torch.equal(va, pool.v), flush=True)
for lens in ([64], [300], [64] * 4, [64] * 8, [64], [300]):
    ids, pos, m = make_step(lens)
    te, tc = [], []
    for r in range(15):
        t = time.perf_counter(); eager(ids, pos, m); te.append(time.perf_counter() - t)
        t = time.perf_counter(); decode(ids, pos, meta_of(m)); tc.append(time.perf_counter() - t)
    me, mc = statistics.median(te) * 1e3, statistics.median(tc) * 1e3
    print(f"B={len(lens)} L={max(lens)} eager {me:.2f} ms segmented({MODE}) {mc:.2f} ms ratio {me / mc:.2f}x", flush=True)
