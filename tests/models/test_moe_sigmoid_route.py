"""The sigmoid router with a choice bias (MoEConfig router "sigmoid_bias": LFM2-MoE's and Nemotron-H's; moe_layer.c's
ROUTE_SIGMOID_BIAS) and ungated squared-ReLU experts (moe_layer.c's ACT_RELU2, the shared expert too): the torch twin
against a float64 reading of transformers' routers, and the one native call (every SIMD variant this CPU runs)
against the torch path around the same grouped matmuls."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.formats.experts import BlockExperts, ExpertBlocks
from edgeserve.models.moe import MoEConfig, MoELayer, SharedExpert, route

from test_moe import HIDDEN, FFN, make_layer

native = pytest.mark.skipif(not cpu_native.available(), reason="native CPU kernels not built")
E, K = 8, 3


def reference_sigmoid_route(logits: torch.Tensor, bias: torch.Tensor, k: int, normalize: bool, eps: float,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (weights, experts) as transformers' NemotronHTopkRouter / Lfm2MoeTopKRouter compute them."""
    probs = torch.sigmoid(logits.double())
    experts = torch.topk(probs + bias.double(), k, dim=-1).indices
    weights = probs.gather(1, experts)
    if normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + eps)
    return weights * scale, experts


def test_twin_is_the_reference_and_the_bias_only_chooses():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, E, generator=g) * 2
    bias = torch.randn(E, generator=g)
    cfg = MoEConfig(E, K, 32, "sigmoid_bias", normalize_topk=True, scale=2.5, norm_eps=1e-20)
    weights, experts = route(logits, cfg, bias)
    want_w, want_e = reference_sigmoid_route(logits, bias, K, True, 1e-20, 2.5)
    assert torch.equal(experts, want_e)
    torch.testing.assert_close(weights.double(), want_w, rtol=1e-6, atol=1e-7)
    assert torch.allclose(weights.sum(-1), torch.full((40,), 2.5))
    # the bias changes the choice, never the weight of a chosen expert (its sigmoid)
    _, unbiased = route(logits, cfg)
    assert not torch.equal(unbiased, experts)
    plain = MoEConfig(E, K, 32, "sigmoid_bias")  # no renormalization, no scale: the sigmoids themselves
    w, e = route(logits, plain, bias)
    assert torch.equal(w, torch.sigmoid(logits).gather(1, e))


def _q8(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """Q8_0 bytes of random weights [..., rows, cols]."""
    import gguf

    w = rng.normal(0, 0.2, size=shape).astype(np.float32)
    flat = gguf.quants.quantize(w.reshape(-1, shape[-1]), gguf.GGMLQuantizationType.Q8_0)
    return flat.reshape(*shape[:-1], -1)


def _shared(rng: np.random.Generator, rows: int, width: int, activation: str) -> SharedExpert:
    from edgeserve.kernels.cpu.native import BlockTensor, BlockWeight

    def weight(r: int, c: int) -> BlockWeight:
        return BlockWeight([BlockTensor("Q8_0", torch.from_numpy(_q8(rng, r, c)), c)])

    return SharedExpert(weight(rows, HIDDEN), weight(HIDDEN, width), activation=activation)


def sigmoid_layer(gated: bool, seed: int = 0) -> MoELayer:
    """A Q8_0 MoE layer with the sigmoid router (choice bias, renormalized, scale 2.5) and a shared expert: SiLU
    gated experts, or (not `gated`) Nemotron-H's ungated squared-ReLU ones."""
    rng = np.random.default_rng(seed)
    bias = torch.from_numpy(rng.normal(0, 0.5, size=E).astype(np.float32))
    if gated:
        cfg = MoEConfig(E, K, FFN, "sigmoid_bias", normalize_topk=True, scale=2.5, norm_eps=1e-6)
        layer, _ = make_layer(cfg, HIDDEN, ("Q8_0", "Q8_0"), seed=seed)
        layer.choice_bias = bias
        layer.shared = _shared(rng, 2 * FFN, FFN, "silu")
        return layer
    cfg = MoEConfig(E, K, FFN, "sigmoid_bias", normalize_topk=True, activation="relu2", gated=False, scale=2.5,
                    norm_eps=1e-20)
    up = BlockExperts([ExpertBlocks("Q8_0", _q8(rng, E, FFN, HIDDEN), HIDDEN)])
    down = BlockExperts([ExpertBlocks("Q8_0", _q8(rng, E, HIDDEN, FFN), FFN)])
    router = torch.from_numpy(rng.normal(0, 1.0, size=(E, HIDDEN)).astype(np.float32))
    return MoELayer(cfg, router, up, down, shared=_shared(rng, 2 * FFN, 2 * FFN, "relu2"), choice_bias=bias)


@native
@pytest.mark.parametrize("variant", cpu_native.supported_variants())
@pytest.mark.parametrize("gated", [True, False])
def test_native_call_matches_the_torch_path(variant: str, gated: bool, monkeypatch):
    """One native call (router, ROUTE_SIGMOID_BIAS, experts, shared expert) gives the torch path's output (the
    twin's routing around the same grouped matmuls) up to float rounding; its rows do not depend on the batch; the
    choice bias and the scale reach it."""
    monkeypatch.setenv("EDGESERVE_NATIVE_VARIANT", variant)
    layer = sigmoid_layer(gated)
    plan = layer.native()
    assert plan is not None and plan.has_shared and plan.struct.route == 2
    h = torch.randn(29, HIDDEN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = layer.forward(h)
    weights, experts = layer.route(h)
    layer._native = None
    want = layer.forward(h)
    scale = want.abs().max().item()
    assert scale > 0 and torch.allclose(got, want, rtol=1e-4, atol=1e-4 * scale)
    layer._native = plan
    assert torch.allclose(layer.mix(h, weights, experts), got, rtol=1e-4, atol=1e-4 * scale)
    for i in (0, 13, 28):
        assert torch.equal(layer.forward(h[i:i + 1])[0], got[i])
    plan.struct.choice_bias = None  # chosen by the sigmoids alone: other experts for some rows
    unbiased = layer.forward(h)
    assert not torch.allclose(unbiased, got, rtol=1e-3, atol=1e-3 * scale)
    plan.struct.scale = 1.0  # the routed part shrinks by 2.5
    shared = layer.shared.forward(h)
    torch.testing.assert_close(layer.forward(h) - shared, (unbiased - shared) / 2.5, rtol=1e-4, atol=1e-4 * scale)


@native
def test_ungated_experts_need_the_ungated_activation():
    """relu2 runs natively on ungated experts only; a gated config naming relu2 (or an ungated one naming SiLU)
    keeps the torch path."""
    from edgeserve.kernels.cpu.moe_layer import ACT_RELU2, activation_code

    assert activation_code("relu2", gated=False)[0] == ACT_RELU2
    assert activation_code("relu2", gated=True) is None and activation_code("silu", gated=False) is None
