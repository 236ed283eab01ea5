"""kernels.torch.mamba2 against transformers' PyTorch Mamba-2 (NemotronHMamba2Mixer over a whole sequence, its chunked
scan and one-step update): the same outputs whatever the steps a ragged batch cuts the sequences into, and states
that carry from step to step."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from edgeserve.kernels.torch.gated_delta import DeltaBatch  # noqa: E402
from edgeserve.kernels.torch.mamba2 import Mamba2Dims, mamba2_mixer, ssd_scan, ssd_step  # noqa: E402

DIMS = Mamba2Dims(num_heads=4, head_dim=8, state_size=6, n_groups=2, conv_kernel=4)


def mixer():
    """A transformers Nemotron-H Mamba-2 mixer of DIMS (float32, weights that make every part matter)."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    cfg = transformers.NemotronHConfig(hidden_size=24, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=6,
                                       n_groups=2, conv_kernel=4, chunk_size=5, layers_block_type=["mamba"],
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=12)
    torch.manual_seed(0)
    m = NemotronHMamba2Mixer(cfg, layer_idx=0).float().eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name == "A_log":
                p.uniform_(-3.0, 0.5)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.3)
            else:
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    return m


def ours(m, h: torch.Tensor, conv_state, ssm_state, batch: DeltaBatch) -> torch.Tensor:
    """Our mixer with m's weights over rows h [T, hidden] of `batch`."""
    with torch.no_grad():
        y = mamba2_mixer(m.in_proj(h), DIMS, m.conv1d.weight.squeeze(1), m.conv1d.bias, m.dt_bias,
                         -torch.exp(m.A_log), m.D, m.norm.weight, m.norm.variance_epsilon, conv_state, ssm_state,
                         batch)
        return m.out_proj(y)


@pytest.mark.parametrize("cuts", [[23], [9, 14], [1] * 23, [7, 1, 1, 14]])
def test_mixer_equals_transformers_over_any_steps(cuts: list[int]) -> None:
    """Two sequences (23 and 11 tokens) fed in steps of `cuts` (the second one's rows until it runs out), each
    continuing from its conv and ssm states, give transformers' whole-sequence outputs."""
    m = mixer()
    torch.manual_seed(1)
    seqs = [torch.randn(23, 24), torch.randn(11, 24)]
    with torch.no_grad():
        want = [m(s[None])[0] for s in seqs]
    conv = torch.zeros(3, DIMS.conv_kernel - 1, DIMS.conv_dim)
    ssm = torch.zeros(3, DIMS.num_heads, DIMS.head_dim, DIMS.state_size)
    got: list[list[torch.Tensor]] = [[], []]
    done = [0, 0]
    for n in cuts:
        parts = [s[d:d + n] for s, d in zip(seqs, done)]
        lens = [p.shape[0] for p in parts]
        batch = DeltaBatch.build([0, lens[0], lens[0] + lens[1]], [2, 0])
        out = ours(m, torch.cat(parts), conv, ssm, batch)
        got[0].append(out[:lens[0]])
        got[1].append(out[lens[0]:])
        done = [d + k for d, k in zip(done, lens)]
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.cat(g), w, atol=2e-5, rtol=1e-4)


def test_chunked_scan_equals_steps() -> None:
    """The chunked scan (any chunk length) leaves the state and outputs that one step per token gives."""
    torch.manual_seed(2)
    t, h, p, g, n = 19, 4, 3, 2, 5
    x, dt = torch.randn(t, h, p), torch.rand(t, h)
    B, C, A, D = torch.randn(t, g, n), torch.randn(t, g, n), -torch.rand(h), torch.randn(h)
    start = torch.randn(1, h, p, n)
    state, ys = start[0:1].clone(), []
    for i in range(t):
        y, state = ssd_step(x[i:i + 1], dt[i:i + 1], A, B[i:i + 1], C[i:i + 1], D, state)
        ys.append(y)
    for chunk in (4, 7, 64):
        pool = start.clone()
        got = ssd_scan(x, dt, A, B, C, D, pool, DeltaBatch.build([0, t], [0]), chunk=chunk)
        torch.testing.assert_close(got, torch.cat(ys), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pool, state, atol=1e-5, rtol=1e-5)
