"""The MoE feed-forward layer (edgeserve.models.moe) against a float64 reference: dequantize, route, matmul."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.formats.experts import BlockExperts, DenseExperts, ExpertBlocks, ExpertGroups
from edgeserve.models.moe import MoEConfig, MoELayer, SharedExpert, route

from support.gguf_writer import finish

native = pytest.mark.skipif(not cpu_native.available(), reason="native CPU kernels not built")


def _blocks(qtype: str, w: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Stored bytes [E, rows, bytes per row] of float weights w [E, rows, cols] in `qtype` (K types: random
    blocks, since gguf-py has no K quantizer; the reference dequantizes whatever is stored)."""
    import gguf

    e, rows, cols = w.shape
    if qtype in ("Q4_K", "Q6_K"):
        from edgeserve.bench.random_gguf import random_blocks

        return np.stack([random_blocks(qtype, rows, cols, rng) for _ in range(e)])
    return gguf.quants.quantize(w.reshape(e * rows, cols), gguf.GGMLQuantizationType[qtype]).reshape(e, rows, -1)


def _dequant(qtype: str, data: np.ndarray) -> torch.Tensor:
    """float64 [E, rows, cols] from stored bytes, by gguf-py's dequantizer (independent of our kernels)."""
    import gguf

    e, rows, _ = data.shape
    flat = gguf.quants.dequantize(data.reshape(e * rows, -1), gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(flat.astype(np.float64)).reshape(e, rows, -1)


def make_layer(cfg: MoEConfig, hidden: int, qtypes: tuple[str, str] | None, seed: int = 0, biases: bool = False,
               shared: str | None = None, router_bias: torch.Tensor | None = None, repack: bool = False):
    """(MoELayer, float64 weights for the reference): experts dense float32 when `qtypes` is None, else GGUF
    blocks (gate_up's type, down's type) on the native kernels (`repack`: in their faster layout).
    `shared`: None, "plain" or "gated"."""
    rng = np.random.default_rng(seed)
    e, f = cfg.num_experts, cfg.intermediate_size
    gu = rng.normal(0, 0.2, size=(e, 2 * f, hidden)).astype(np.float32)
    dn = rng.normal(0, 0.2, size=(e, hidden, f)).astype(np.float32)
    router = torch.from_numpy(rng.normal(0, 1.0, size=(e, hidden)).astype(np.float32))
    ref = {"router": router.double(), "router_bias": None if router_bias is None else router_bias.double()}
    if qtypes is None:
        gate_up, down = DenseExperts(torch.from_numpy(gu)), DenseExperts(torch.from_numpy(dn))
        ref["gate_up"], ref["down"] = torch.from_numpy(gu).double(), torch.from_numpy(dn).double()
    else:
        # gate and up as two parts (as GGUF stores them), possibly of different types
        g, u, d = _blocks(qtypes[0], gu[:, :f], rng), _blocks(qtypes[0], gu[:, f:], rng), _blocks(qtypes[1], dn, rng)
        gate_up = BlockExperts([ExpertBlocks(qtypes[0], g, hidden), ExpertBlocks(qtypes[0], u, hidden)], repack=repack)
        down = BlockExperts([ExpertBlocks(qtypes[1], d, f)], repack=repack)
        ref["gate_up"] = torch.cat([_dequant(qtypes[0], g), _dequant(qtypes[0], u)], dim=1)
        ref["down"] = _dequant(qtypes[1], d)
    gu_bias = torch.from_numpy(rng.normal(0, 0.3, size=(e, 2 * f)).astype(np.float32)) if biases else None
    dn_bias = torch.from_numpy(rng.normal(0, 0.3, size=(e, hidden)).astype(np.float32)) if biases else None
    ref["gate_up_bias"] = None if gu_bias is None else gu_bias.double()
    ref["down_bias"] = None if dn_bias is None else dn_bias.double()
    shared_expert = None
    if shared is not None:
        s_gu = torch.from_numpy(rng.normal(0, 0.2, size=(2 * f, hidden)).astype(np.float32))
        s_dn = torch.from_numpy(rng.normal(0, 0.2, size=(hidden, f)).astype(np.float32))
        s_gate = torch.from_numpy(rng.normal(0, 0.3, size=(1, hidden)).astype(np.float32)) if shared == "gated" else None
        shared_expert = SharedExpert(s_gu, s_dn, s_gate)
        ref["shared"] = (s_gu.double(), s_dn.double(), None if s_gate is None else s_gate.double())
    layer = MoELayer(cfg, router, gate_up, down, router_bias=router_bias, gate_up_bias=gu_bias, down_bias=dn_bias,
                     shared=shared_expert)
    return layer, ref


def _silu_mul(gu: torch.Tensor) -> torch.Tensor:
    g, u = gu.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


def reference_route(h: torch.Tensor, ref: dict, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 (weights [T, k], experts [T, k], gap [T]): gap is how far the k-th choice's logit is above the
    next one's (tokens with a tiny gap may legitimately route differently)."""
    logits = h.double() @ ref["router"].T
    if ref["router_bias"] is not None:
        logits = logits + ref["router_bias"]
    k = cfg.experts_per_token
    top, experts = torch.topk(logits, min(k + 1, logits.shape[1]), dim=-1)  # softmax keeps the logits' order
    gap = top[:, k - 1] - top[:, k] if k < logits.shape[1] else torch.full((h.shape[0],), float("inf"))
    top, experts = top[:, :k], experts[:, :k]
    if cfg.router == "topk_softmax":
        weights = torch.softmax(top, -1)
    else:
        weights = torch.softmax(logits, -1).gather(1, experts)
        if cfg.normalize_topk:
            weights = weights / weights.sum(-1, keepdim=True)
    return weights, experts, gap


def reference_moe(h: torch.Tensor, ref: dict, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (output [T, hidden], routing gap [T]) of the layer, one token and one expert at a time."""
    weights, experts, gap = reference_route(h, ref, cfg)
    x = h.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(cfg.experts_per_token):
            e = int(experts[t, j])
            gu = ref["gate_up"][e] @ x[t]
            if ref["gate_up_bias"] is not None:
                gu = gu + ref["gate_up_bias"][e]
            y = ref["down"][e] @ _silu_mul(gu)
            if ref["down_bias"] is not None:
                y = y + ref["down_bias"][e]
            out[t] += weights[t, j] * y
    if "shared" in ref:
        s_gu, s_dn, s_gate = ref["shared"]
        y = _silu_mul(x @ s_gu.T) @ s_dn.T
        if s_gate is not None:
            y = y * torch.sigmoid(x @ s_gate.T)
        out += y
    return out, gap


def check(layer: MoELayer, ref: dict, cfg: MoEConfig, h: torch.Tensor, rel: float) -> torch.Tensor:
    """Compare layer(h) with the reference on the tokens whose routing is not a near-tie; returns the output."""
    out = layer.forward(h)
    assert out.dtype == torch.float32 and out.shape == h.shape
    want, gap = reference_moe(h, ref, cfg)
    clear = gap > 1e-3
    assert clear.float().mean() >= 0.8, "the test data should route most tokens clearly"
    err = (out.double() - want)[clear].abs().max()
    assert err <= rel * want.abs().max(), f"max error {err:.3g} vs output scale {want.abs().max():.3g}"
    return out


HIDDEN, FFN = 64, 32
CASES = {
    "softmax_topk": MoEConfig(8, 2, FFN, "softmax_topk"),
    "softmax_topk_renorm": MoEConfig(8, 2, FFN, "softmax_topk", normalize_topk=True),
    "topk_softmax": MoEConfig(8, 4, FFN, "topk_softmax"),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("tokens", [1, 7, 37])
def test_dense_experts_match_float64_reference(name: str, tokens: int):
    cfg = CASES[name]
    layer, ref = make_layer(cfg, HIDDEN, None, seed=tokens)
    h = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    check(layer, ref, cfg, h, rel=1e-5)


@native
@pytest.mark.parametrize("repack", [False, True])
@pytest.mark.parametrize("qtypes", [("Q8_0", "Q8_0"), ("Q4_0", "Q8_0")])
@pytest.mark.parametrize("name", list(CASES))
def test_block_experts_match_float64_reference(qtypes: tuple[str, str], name: str, repack: bool):
    cfg = CASES[name]
    layer, ref = make_layer(cfg, HIDDEN, qtypes, seed=3, repack=repack)
    assert all(p.qtype.endswith("_X8") == repack for p in layer.gate_up.parts + layer.down.parts)
    h = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    check(layer, ref, cfg, h, rel=0.03)  # activations are quantized to int8 blocks


@native
@pytest.mark.parametrize("repack", [False, True])
def test_k_quant_experts_match_float64_reference(repack: bool):
    cfg = MoEConfig(8, 2, 256, "softmax_topk", normalize_topk=True)
    layer, ref = make_layer(cfg, 256, ("Q4_K", "Q6_K"), seed=4, repack=repack)
    h = torch.randn(9, 256, generator=torch.Generator().manual_seed(6))
    check(layer, ref, cfg, h, rel=0.03)


@pytest.mark.parametrize("qtypes", [None, pytest.param(("Q8_0", "Q8_0"), marks=native)])
def test_biases_and_shared_expert(qtypes):
    cfg = MoEConfig(8, 2, FFN, "topk_softmax")
    for shared in ("plain", "gated"):
        layer, ref = make_layer(cfg, HIDDEN, qtypes, seed=7, biases=True, shared=shared,
                                router_bias=torch.linspace(-1, 1, 8))
        h = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(8))
        check(layer, ref, cfg, h, rel=1e-5 if qtypes is None else 0.03)


@pytest.mark.parametrize("qtypes", [None, pytest.param(("Q8_0", "Q8_0"), marks=native)])
def test_all_tokens_to_one_expert(qtypes):
    cfg = MoEConfig(8, 1, FFN, "softmax_topk")
    bias = torch.zeros(8)
    bias[5] = 1000.0  # expert 5 wins every token
    layer, ref = make_layer(cfg, HIDDEN, qtypes, seed=9, router_bias=bias)
    h = torch.randn(13, HIDDEN, generator=torch.Generator().manual_seed(10))
    _, experts = layer.route(h)
    assert experts.unique().tolist() == [5]
    check(layer, ref, cfg, h, rel=1e-5 if qtypes is None else 0.03)


@pytest.mark.parametrize("qtypes,repack", [(None, False), pytest.param(("Q4_0", "Q8_0"), False, marks=native),
                                           pytest.param(("Q4_0", "Q8_0"), True, marks=native)])
def test_tokens_over_every_expert_are_batch_invariant(qtypes, repack: bool):
    """Each token's output is the same bits whether it runs alone or among 37 tokens that use every expert."""
    cfg = MoEConfig(8, 2, FFN, "softmax_topk", normalize_topk=True)
    layer, _ = make_layer(cfg, HIDDEN, qtypes, seed=11, shared="gated", repack=repack)
    h = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(12))
    if qtypes is not None:
        h = h.to(torch.bfloat16)
    _, experts = layer.route(h)
    assert experts.unique().numel() == 8
    together = layer.forward(h)
    for i in (0, 17, 36):
        assert torch.equal(layer.forward(h[i:i + 1])[0], together[i])
    assert torch.equal(layer.forward(h[3:20]), together[3:20])


def test_route_orders_and_normalizes():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    w, e = route(logits, MoEConfig(4, 2, 8, "topk_softmax"))
    assert e.tolist() == [[1, 3]]
    assert torch.allclose(w, torch.softmax(torch.tensor([[3.0, 2.0]]), -1))
    w, e = route(logits, MoEConfig(4, 2, 8, "softmax_topk"))
    p = torch.softmax(logits, -1)
    assert e.tolist() == [[1, 3]] and torch.allclose(w, p[:, [1, 3]])
    w, _ = route(logits, MoEConfig(4, 2, 8, "softmax_topk", normalize_topk=True))
    assert torch.allclose(w.sum(-1), torch.ones(1))


def test_expert_groups_sort_rows_by_expert():
    experts = torch.tensor([[2, 0], [0, 3], [2, 3]])
    g = ExpertGroups.build(experts, 5)
    assert g.active == [(0, 0, 2), (2, 2, 4), (3, 4, 6)]
    assert g.token.tolist() == [0, 1, 0, 2, 1, 2]
    assert g.expert.tolist() == [0, 0, 2, 2, 3, 3]
    assert torch.equal(g.expert[g.inverse].view(3, 2), experts)


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="router"):
        MoEConfig(8, 2, 16, "sigmoid")
    with pytest.raises(ValueError, match="experts_per_token"):
        MoEConfig(8, 9, 16)
    with pytest.raises(ValueError, match="activation"):
        MoELayer(MoEConfig(2, 1, 4, activation="nope"), torch.zeros(2, 8), DenseExperts(torch.zeros(2, 8, 8)),
                 DenseExperts(torch.zeros(2, 8, 4)))


@native
@pytest.mark.parametrize("repack", [False, True])
@pytest.mark.parametrize("tokens", [1, 3, 70])
def test_one_native_call_equals_a_matmul_per_expert(tokens: int, repack: bool):
    """qmm_moe_matmul (every active expert in one threaded call) gives the same bits as one qmm_matmul per expert,
    for formats with and without offset sums, GGUF and repacked layouts, and experts with very different row
    counts."""
    cfg = MoEConfig(8, 3, 256, "softmax_topk")
    layer, _ = make_layer(cfg, 256, ("Q4_K", "Q6_K"), seed=13, repack=repack)
    layer._native = None  # the torch path around BlockExperts.grouped, whose two ways are compared here
    h = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16)
    assert layer.gate_up.one_call
    one_call = layer.forward(h)
    layer.gate_up.one_call = layer.down.one_call = False
    per_expert = layer.forward(h)
    assert one_call.abs().max() > 0
    assert torch.equal(one_call, per_expert)


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_router_matmul_is_exact_and_row_independent(dtype):
    w = torch.randn(40, 203, generator=torch.Generator().manual_seed(15))  # K not a multiple of the SIMD width
    x = torch.randn(21, 203, generator=torch.Generator().manual_seed(16)).to(dtype)
    got = cpu_native.f32_matmul(x, w)
    want = x.double() @ w.double().T
    assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-5)
    assert torch.equal(cpu_native.f32_matmul(x[5:6], w)[0], got[5])
    assert torch.equal(cpu_native.f32_matmul(x[::2], w), got[::2])  # strided rows


@pytest.mark.parametrize("qtype", ["F32", pytest.param("Q8_0", marks=native)])
def test_gguf_expert_tensors_load_with_biases_and_a_gated_shared_expert(tmp_path, qtype: str):
    """load_moe_layer over a GGUF's llama.cpp names: router + bias, split gate / up experts with biases, down with
    its bias, a shared expert and its gate; float32 loads dense experts, bfloat16 keeps block formats natively."""
    import gguf

    from edgeserve.loaders.gguf_file import GGUFFile
    from edgeserve.loaders.gguf_weights import GGUFWeights
    from edgeserve.models.config import ModelConfig
    from edgeserve.models.moe_weights import load_moe_layer

    e, k, f, hidden = 8, 2, FFN, HIDDEN
    rng = np.random.default_rng(17)
    arrays = {
        "ffn_gate_inp.weight": rng.normal(0, 1.0, (e, hidden)), "ffn_gate_inp.bias": rng.normal(0, 0.5, (e,)),
        "ffn_gate_exps.weight": rng.normal(0, 0.2, (e, f, hidden)), "ffn_up_exps.weight": rng.normal(0, 0.2, (e, f, hidden)),
        "ffn_down_exps.weight": rng.normal(0, 0.2, (e, hidden, f)), "ffn_gate_exps.bias": rng.normal(0, 0.3, (e, f)),
        "ffn_up_exps.bias": rng.normal(0, 0.3, (e, f)), "ffn_down_exps.bias": rng.normal(0, 0.3, (e, hidden)),
        "ffn_gate_shexp.weight": rng.normal(0, 0.2, (f, hidden)), "ffn_up_shexp.weight": rng.normal(0, 0.2, (f, hidden)),
        "ffn_down_shexp.weight": rng.normal(0, 0.2, (hidden, f)), "ffn_gate_inp_shexp.weight": rng.normal(0, 0.3, (1, hidden)),
    }
    w = gguf.GGUFWriter(str(tmp_path / "moe.gguf"), arch="qwen3moe")
    stored = {}
    for name, a in arrays.items():
        a = a.astype(np.float32)
        if qtype != "F32" and name.endswith(("exps.weight", "shexp.weight")):
            kind = gguf.GGMLQuantizationType[qtype]
            blocks = gguf.quants.quantize(a, kind)
            w.add_tensor(f"blk.0.{name}", blocks, raw_dtype=kind)
            a = gguf.quants.dequantize(blocks, kind)
        else:
            w.add_tensor(f"blk.0.{name}", a)
        stored[name] = torch.from_numpy(np.asarray(a, dtype=np.float64))
    finish(w)
    config = ModelConfig("qwen3moe", 32, hidden, 0, 1, 4, 2, 16, 1e-6, 1e4, 64, False, num_experts=e,
                         experts_per_token=k, moe_intermediate_size=f)
    cfg = MoEConfig(e, k, f, "topk_softmax")
    dtype = torch.float32 if qtype == "F32" else torch.bfloat16

    def matrix(names):
        from edgeserve.kernels.cpu.native import block_weight

        return block_weight(source, names, torch.device("cpu"), dtype) or torch.cat(
            [source.get(n, keep_int4=False) for n in names]).to(dtype)

    source = GGUFWeights(GGUFFile(tmp_path / "moe.gguf"), 4, 2)
    layer = load_moe_layer(config, source, 0, matrix, torch.device("cpu"), dtype, moe=cfg)
    assert isinstance(layer.gate_up, DenseExperts if qtype == "F32" else BlockExperts)
    if qtype != "F32":  # one native call (moe_layer.c), the gated shared expert inside it
        assert layer.native() is not None and layer.native().has_shared
    s = stored
    ref = {"router": s["ffn_gate_inp.weight"], "router_bias": s["ffn_gate_inp.bias"],
           "gate_up": torch.cat([s["ffn_gate_exps.weight"], s["ffn_up_exps.weight"]], dim=1),
           "down": s["ffn_down_exps.weight"],
           "gate_up_bias": torch.cat([s["ffn_gate_exps.bias"], s["ffn_up_exps.bias"]], dim=1),
           "down_bias": s["ffn_down_exps.bias"],
           "shared": (torch.cat([s["ffn_gate_shexp.weight"], s["ffn_up_shexp.weight"]]), s["ffn_down_shexp.weight"],
                      s["ffn_gate_inp_shexp.weight"])}
    h = torch.randn(19, hidden, generator=torch.Generator().manual_seed(18)).to(dtype)
    check(layer, ref, cfg, h, rel=1e-5 if qtype == "F32" else 0.03)


def _block_shared(hidden: int, f: int, seed: int) -> SharedExpert:
    """A gated shared expert with Q8_0 block weights (as a GGUF's, on the native kernels)."""
    import gguf

    from edgeserve.kernels.cpu.native import BlockTensor, BlockWeight

    rng = np.random.default_rng(seed)

    def blocks(rows: int, cols: int) -> BlockWeight:
        data = gguf.quants.quantize(rng.normal(0, 0.2, size=(rows, cols)).astype(np.float32),
                                    gguf.GGMLQuantizationType.Q8_0)
        return BlockWeight([BlockTensor("Q8_0", torch.from_numpy(data), cols)])

    gate = torch.from_numpy(rng.normal(0, 0.3, size=(1, hidden)).astype(np.float32))
    return SharedExpert(blocks(2 * f, hidden), blocks(hidden, f), gate)


@native
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("name", list(CASES))
def test_one_native_layer_call_matches_the_torch_path(name: str, activation: str):
    """MoELayer's one native call (kernels/cpu/src/moe_layer.c: router + bias, routing, grouping, expert matmuls and
    biases, SiLU or gpt-oss's clamped SwiGLU, the slot sum, a block-weight shared expert with its sigmoid gate) gives
    the torch path's output around the same grouped matmuls, up to float rounding, with its own routing and with a
    routing handed in (`mix`); its rows do not depend on the batch."""
    import dataclasses
    import functools

    from edgeserve.kernels.dispatch import swiglu_oai

    cfg = CASES[name]
    if activation == "swiglu_oai":
        cfg = dataclasses.replace(cfg, activation=functools.partial(swiglu_oai, alpha=1.702, limit=7.0))
    bias = torch.randn(8, generator=torch.Generator().manual_seed(20)) * 0.5
    layer, _ = make_layer(cfg, HIDDEN, ("Q4_0", "Q8_0"), seed=19, biases=True, router_bias=bias)
    layer.shared = _block_shared(HIDDEN, FFN, 21)
    layer.shared.activation = cfg.activation
    native_plan = layer.native()
    assert native_plan is not None and native_plan.has_shared
    h = torch.randn(29, HIDDEN, generator=torch.Generator().manual_seed(22)).to(torch.bfloat16)
    got = layer.forward(h)
    weights, experts = layer.route(h)
    given = layer.mix(h, weights, experts)
    layer._native = None
    want = layer.forward(h)
    assert want.abs().max() > 0
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert torch.allclose(given, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    layer._native = native_plan
    for i in (0, 13, 28):
        assert torch.equal(layer.forward(h[i:i + 1])[0], got[i])
    native_plan.lib.qmm_moe_release()  # the kept scratch given back: the next call maps its own again
    assert torch.equal(layer.forward(h), got)
    assert not torch.allclose(layer.mix(h, weights, experts.flip(-1)), got)  # the routing handed in is used
