"""Probe: the whole decode forward (30 layers + head) under torch.compile (inductor, CPU), dynamic batch and context.

Checks logits and KV pool against the eager engine forward bit for bit, then times eager vs compiled steps
alternately. Measured result (2026-11-22, see docs/PERFORMANCE.md): first compile 160-194 s, one mismatching case,
compiled 0.14x-0.65x the speed of eager (the functionalized KV writes copy the whole pool every step).

    python benchmarks/compile_probes/whole_graph.py [NUM_BLOCKS=512]
"""
from __future__ import annotations

import sys, time, statistics, torch, torch.nn.functional as F
from common import decode_fn
from edgeserve.models.load import load_model
from edgeserve.registry import resolve
from edgeserve.engine.kv_cache import KVPool, PagedKVAttention
from edgeserve.kernels.paged_attention import AttentionMetadata

torch.manual_seed(0)
t0 = time.time()
lm = load_model(resolve("smollm2-135m"))
print("load", time.time() - t0, flush=True)
model, cfg = lm.model, lm.config
BS = 16
NBLK = int(sys.argv[1]) if len(sys.argv) > 1 else 512
pool = KVPool(cfg, NBLK, BS, model.dtype)
pool.k.normal_(); pool.v.normal_()


decode = decode_fn(model)

def make_step(lens):
    # sequence i owns blocks i*64 ...; its new token at position lens[i]-1
    tables = [list(range(i * 64, i * 64 + -(-L // BS))) for i, L in enumerate(lens)]
    slots = [t[(L - 1) // BS] * BS + (L - 1) % BS for t, L in zip(tables, lens)]
    ids = torch.randint(0, cfg.vocab_size, (len(lens),))
    pos = torch.tensor([L - 1 for L in lens])
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, slots)
    return ids, pos, meta, tables


def compiled_inputs(ids, pos, meta, tables, lens):
    L = max(lens)
    p = torch.arange(L)
    t = meta.block_tables.long()
    kv_slots = t[:, p // BS] * BS + p % BS
    mask = (p[None, :] < meta.seq_lens[:, None])[:, None, None, :]
    return ids, pos, meta.slot_mapping, kv_slots, mask


def eager(ids, pos, meta):
    with torch.inference_mode():
        return model.logits(model.forward(ids, pos, PagedKVAttention(pool, meta)))


import torch._dynamo, torch._inductor.config as icfg
icfg.emulate_precision_casts = True
cdecode = torch.compile(decode, dynamic=None)

def run_c(args):
    ids, pos, sm, kvs, mask = args
    for tns in (ids, pos, sm):
        torch._dynamo.mark_dynamic(tns, 0)
    torch._dynamo.mark_dynamic(kvs, 0); torch._dynamo.mark_dynamic(kvs, 1)
    torch._dynamo.mark_dynamic(mask, 0); torch._dynamo.mark_dynamic(mask, 3)
    with torch.no_grad():
        return cdecode(ids, pos, sm, kvs, mask, pool.k, pool.v)[0]

for lens in ([37], [100], [5, 64, 200], [40, 41, 42, 300, 7]):
    ids, pos, meta, tables = make_step(lens)
    k0, v0 = pool.k.clone(), pool.v.clone()
    a = eager(ids, pos, meta)
    ka, va = pool.k.clone(), pool.v.clone()
    pool.k.copy_(k0); pool.v.copy_(v0)
    t = time.time()
    b = run_c(compiled_inputs(ids, pos, meta, tables, lens))
    print(lens, "compile/run s", round(time.time() - t, 1), "logits equal", torch.equal(a, b), (a - b).abs().max().item(),
          "kv equal", torch.equal(ka, pool.k), torch.equal(va, pool.v), flush=True)

# timing interleaved
for lens in ([64], [300], [64] * 4, [64] * 8, [64], [300]):
    ids, pos, meta, tables = make_step(lens)
    ci = compiled_inputs(ids, pos, meta, tables, lens)
    run_c(ci)
    te, tc = [], []
    for r in range(15):
        t = time.perf_counter(); eager(ids, pos, AttentionMetadata.build([1] * len(lens), lens, tables, meta.slot_mapping.tolist())); te.append(time.perf_counter() - t)
        t = time.perf_counter(); run_c(compiled_inputs(ids, pos, meta, tables, lens)); tc.append(time.perf_counter() - t)
    me, mc = statistics.median(te) * 1e3, statistics.median(tc) * 1e3
    print(f"B={len(lens)} L={max(lens)} eager {me:.2f} ms compiled {mc:.2f} ms ratio {me / mc:.2f}x", flush=True)
