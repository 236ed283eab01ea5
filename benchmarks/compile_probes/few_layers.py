"""Probe: the decode forward cut to the first NL layers under torch.compile: exactness, and compiled step time with a
small vs a large KV pool (a whole-pool copy shows as time growing with the pool).

EMU=1 sets torch._inductor.config.emulate_precision_casts (without it the compiled bf16 silu-mul rounds once
instead of twice and results differ).

    EMU=1 python benchmarks/compile_probes/few_layers.py 2 4096
"""
import sys, time, os, torch, torch.nn.functional as F
from common import decode_fn
from edgeserve.models.load import load_model
from edgeserve.registry import resolve
from edgeserve.engine.kv_cache import KVPool, PagedKVAttention
from edgeserve.kernels.paged_attention import AttentionMetadata
import torch._inductor.config as icfg
if os.environ.get("EMU"): icfg.emulate_precision_casts = True
torch.manual_seed(0)
lm = load_model(resolve("smollm2-135m"))
model, cfg = lm.model, lm.config
NL = int(sys.argv[1]); model.layers = model.layers[:NL]; import dataclasses; cfg = dataclasses.replace(cfg, num_layers=NL)
BS = 16
pool = KVPool(cfg, 64, BS, model.dtype)
pool.k.normal_(); pool.v.normal_()

decode = decode_fn(model)
cdecode = torch.compile(decode)

lens = [37, 50]
tables = [list(range(i * 8, i * 8 + -(-L // BS))) for i, L in enumerate(lens)]
slots = [t[(L - 1) // BS] * BS + (L - 1) % BS for t, L in zip(tables, lens)]
ids = torch.tensor([100, 200]); pos = torch.tensor([L - 1 for L in lens])
meta = AttentionMetadata.build([1] * len(lens), lens, tables, slots)
L = max(lens); p = torch.arange(L); kv_slots = meta.block_tables.long()[:, p // BS] * BS + p % BS
mask = (p[None, :] < meta.seq_lens[:, None])[:, None, None, :]
k0, v0 = pool.k.clone(), pool.v.clone()
with torch.inference_mode():
    h_e = model.forward(ids, pos, PagedKVAttention(pool, meta)); a = model.logits(h_e)
ka, va = pool.k.clone(), pool.v.clone()
pool.k.copy_(k0); pool.v.copy_(v0)
with torch.no_grad():
    b, h_c = decode(ids, pos, meta.slot_mapping, kv_slots, mask, pool.k, pool.v)
print("uncompiled-new-path equal", torch.equal(a, b), torch.equal(ka, pool.k))
pool.k.copy_(k0); pool.v.copy_(v0)
t = time.time()
with torch.no_grad():
    b, h_c = cdecode(ids, pos, meta.slot_mapping, kv_slots, mask, pool.k, pool.v)
print("compile s", time.time() - t)
print("logits equal", torch.equal(a, b), (a - b).abs().max().item(), "hidden", torch.equal(h_e, h_c), (h_e.float() - h_c.float()).abs().max().item())
print("K equal", torch.equal(ka, pool.k), "V equal", torch.equal(va, pool.v))
for l in range(NL):
    print(l, "K diff at slots", (ka[l].view(-1, 3, 64)[slots].float() - pool.k[l].view(-1, 3, 64)[slots].float()).abs().max().item(),
          "V", (va[l].view(-1, 3, 64)[slots].float() - pool.v[l].view(-1, 3, 64)[slots].float()).abs().max().item())
import statistics
big = KVPool(cfg, int(sys.argv[2]), BS, model.dtype)
for name, pk, pv in (("small", pool.k, pool.v), ("big", big.k, big.v), ("small", pool.k, pool.v), ("big", big.k, big.v)):
    ts = []
    for r in range(20):
        t = time.perf_counter()
        with torch.no_grad():
            cdecode(ids, pos, meta.slot_mapping, kv_slots, mask, pk, pv)
        ts.append(time.perf_counter() - t)
    te = []
    for r in range(20):
        t = time.perf_counter()
        with torch.inference_mode():
            model.logits(model.forward(ids, pos, PagedKVAttention(pool, AttentionMetadata.build([1] * len(lens), lens, tables, slots))))
        te.append(time.perf_counter() - t)
    print(name, "compiled ms", statistics.median(ts) * 1e3, "eager ms", statistics.median(te) * 1e3, flush=True)
