"""Probe: each small kernel twin (rms_norm, add_rms_norm, silu_and_mul, rope, float64 decode attention) eager vs
torch.compile, bit for bit; EMU=1 sets emulate_precision_casts.

    python benchmarks/compile_probes/ops.py; EMU=1 python benchmarks/compile_probes/ops.py
"""
import os, torch, torch.nn.functional as F
import torch._inductor.config as icfg
if os.environ.get("EMU"): icfg.emulate_precision_casts = True
from edgeserve.kernels import norm, activation, rope
torch.manual_seed(0)
def chk(name, f, *args):
    with torch.no_grad():
        a = f(*args); b = torch.compile(f)(*args)
    if isinstance(a, tuple):
        print(name, [torch.equal(x, y) for x, y in zip(a, b)], [(x.float()-y.float()).abs().max().item() for x, y in zip(a, b)])
    else:
        print(name, torch.equal(a, b), (a.float()-b.float()).abs().max().item())
x = torch.randn(3, 576); w = torch.randn(576) ; xb = torch.randn(3, 576).bfloat16()
chk("rms_norm f32", lambda x, w: norm.rms_norm(x, w, 1e-5).bfloat16(), x, w)
chk("add_rms_norm", lambda y, r, w: norm.add_rms_norm(y, r, w, 1e-5, torch.bfloat16), xb, x, w)
gu = torch.randn(3, 2*1536).bfloat16()
chk("silu_mul", activation.silu_and_mul, gu)
q = torch.randn(3, 9, 64).bfloat16(); k = torch.randn(3, 3, 64).bfloat16()
cos, sin = torch.randn(3, 32), torch.randn(3, 32)
chk("rope", lambda q, k, c, s: rope.apply_rope(torch.cat([q, k], 1), c, s).bfloat16(), q, k, cos, sin)
L = 40
K = torch.randn(3, 3, L, 64).bfloat16(); V = torch.randn(3, 3, L, 64).bfloat16()
mask = (torch.arange(L)[None, :] < torch.tensor([10, 40, 33])[:, None])[:, None, None, :]
def att(q, K, V, mask):
    o = F.scaled_dot_product_attention(q.double().unsqueeze(2), K.double(), V.double(), attn_mask=mask, enable_gqa=True)
    return o.squeeze(2).bfloat16()
chk("attn", att, q, K, V, mask)
