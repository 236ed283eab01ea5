"""gpt-oss's clamped SwiGLU (swiglu_oai): the torch twin against transformers' expert gate, and the native kernel
(every variant this CPU runs) and dispatch against the twin, across the clamps and the exp's range."""

from __future__ import annotations

import pytest
import torch

from edgeserve.kernels.torch import activation

from edgeserve.kernels.cpu import native as cpu_native

from edgeserve.kernels import dispatch


def rows(t: int = 6, f: int = 1100, seed: int = 0) -> torch.Tensor:
    """[gate | up] rows that cross both clamps (|x| up to 12 with limit 7) and saturate the sigmoid both ways."""
    g = torch.Generator().manual_seed(seed)
    gate = torch.cat([torch.linspace(-60, 60, 200).expand(t, -1), torch.randn(t, f - 200, generator=g) * 5], dim=1)
    up = torch.randn(t, f, generator=g) * 6
    return torch.cat([gate, up], dim=1)


def test_twin_is_transformers_gate_of_the_interleaved_layout():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(num_hidden_layers=1, hidden_size=8, intermediate_size=16, num_local_experts=2)
    experts = GptOssExperts(cfg)
    x = rows(f=300)
    interleaved = torch.stack(x.chunk(2, dim=1), dim=-1).flatten(1)  # HF's [g0, u0, g1, u1, ...]
    torch.testing.assert_close(activation.swiglu_oai(x), experts._apply_gate(interleaved))
    # the clamps matter: without them the large gates and ups give other values
    gate, up = x.chunk(2, dim=1)
    assert (activation.swiglu_oai(x) - (up + 1) * gate * torch.sigmoid(1.702 * gate)).abs().max() > 1


@pytest.mark.skipif(not cpu_native.available(), reason="no native CPU kernels here")
@pytest.mark.parametrize("variant", cpu_native.supported_variants())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_matches_twin(variant, dtype, monkeypatch):
    monkeypatch.setenv("EDGESERVE_NATIVE_VARIANT", variant)
    x = rows().to(dtype)
    got = cpu_native.swiglu_oai(x, 1.702, 7.0)
    assert got is not None and got.dtype == torch.float32
    torch.testing.assert_close(got, activation.swiglu_oai(x.float()), rtol=1e-5, atol=1e-5)
    other = cpu_native.swiglu_oai(x, 1.0, 3.0)  # alpha and limit are taken from the call
    torch.testing.assert_close(other, activation.swiglu_oai(x.float(), 1.0, 3.0), rtol=1e-5, atol=1e-5)
    # a strided view of a wider matmul output
    wide = torch.cat([x, torch.zeros(x.shape[0], 5, dtype=dtype)], dim=1)[:, : x.shape[1]]
    torch.testing.assert_close(cpu_native.swiglu_oai(wide, 1.702, 7.0), got, rtol=0, atol=0)


def test_dispatch_matches_twin():
    x = rows(t=3, f=300)
    for name in ("auto", "torch"):
        with dispatch.force_backend(name):
            torch.testing.assert_close(dispatch.swiglu_oai(x), activation.swiglu_oai(x), rtol=1e-5, atol=1e-5)
