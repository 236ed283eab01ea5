"""kernels.dispatch: the backend choice rules, and that everything runs on the torch twins without Triton."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from edgeserve.kernels import dispatch


def test_default_is_auto_and_cpu_takes_the_twins(monkeypatch):
    monkeypatch.delenv("EDGESERVE_KERNELS", raising=False)
    assert dispatch.backend() == "auto"
    assert not dispatch.use_triton("cpu")
    assert not dispatch.triton_capable("cpu")
    assert dispatch.compute_dtype("cpu") == torch.bfloat16


def test_environment_and_force_backend(monkeypatch):
    monkeypatch.setenv("EDGESERVE_KERNELS", "torch")
    assert dispatch.backend() == "torch" and not dispatch.use_triton("cpu")
    with dispatch.force_backend("auto"):
        assert dispatch.backend() == "auto"
        with dispatch.force_backend("torch"):
            assert dispatch.backend() == "torch"
        assert dispatch.backend() == "auto"
    assert dispatch.backend() == "torch"
    monkeypatch.setenv("EDGESERVE_KERNELS", "cuda")
    with pytest.raises(ValueError, match="EDGESERVE_KERNELS"):
        dispatch.backend()
    with pytest.raises(ValueError):
        with dispatch.force_backend("fast"):
            pass


def test_forced_triton_on_cpu_needs_the_interpreter(monkeypatch):
    if not dispatch.HAS_TRITON:
        with dispatch.force_backend("triton"), pytest.raises(RuntimeError, match="not installed"):
            dispatch.use_triton("cpu")
        return
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with dispatch.force_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        dispatch.silu_and_mul(torch.randn(2, 8))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with dispatch.force_backend("triton"):
        assert dispatch.use_triton("cpu")


def test_capability_window(monkeypatch):
    """sm_75 .. sm_90 take Triton under auto; sm_70 and sm_100 do not; sm_75 computes in float16."""
    monkeypatch.delenv("EDGESERVE_KERNELS", raising=False)
    monkeypatch.setattr(dispatch, "HAS_TRITON", True)
    monkeypatch.setattr(torch.version, "hip", None)
    for cap, expected in [((7, 0), False), ((7, 5), True), ((8, 0), True), ((8, 9), True), ((9, 0), True),
                          ((10, 0), False)]:
        monkeypatch.setattr(dispatch, "_capability", lambda device, cap=cap: cap)
        assert dispatch.use_triton("cuda:0") is expected, cap
    monkeypatch.setattr(dispatch, "_capability", lambda device: (7, 5))
    assert dispatch.compute_dtype("cuda") == torch.float16
    monkeypatch.setattr(dispatch, "_capability", lambda device: (8, 6))
    assert dispatch.compute_dtype("cuda") == torch.bfloat16


def test_twins_match_the_original_functions(monkeypatch):
    """On CPU under auto without the native kernels, each dispatch function is exactly the twin it replaces
    (the native ones are tested against the twins in test_cpu_kernels.py)."""
    from edgeserve.kernels.torch import activation
    from edgeserve.kernels.torch import norm
    from edgeserve.kernels.torch import rope

    monkeypatch.setenv("EDGESERVE_NATIVE", "0")
    x = torch.randn(3, 16)
    w = torch.randn(16)
    assert torch.equal(dispatch.rms_norm(x, w, 1e-6), norm.rms_norm(x, w, 1e-6))
    assert torch.equal(dispatch.silu_and_mul(x), activation.silu_and_mul(x))
    cos, sin = torch.randn(3, 8), torch.randn(3, 8)
    kc, vc = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    q = dispatch.rope_write_kv(x.view(3, 1, 16), x.view(3, 1, 16), x.view(3, 1, 16), cos, sin, kc, vc,
                               torch.tensor([0, 5, 6]))
    assert torch.equal(q, rope.apply_rope(x.view(3, 1, 16), cos, sin))
    assert torch.equal(kc.view(-1, 16)[5], q[1, 0]) and torch.equal(vc.view(-1, 16)[6], x[2])


def test_package_runs_without_triton():
    """With `import triton` failing, the kernels package imports and every dispatch function runs its twin."""
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        import torch
        from edgeserve.kernels import dispatch
        from edgeserve.kernels.formats.quant_linear import Q4Blocks, Q8Blocks
        assert not dispatch.HAS_TRITON and not dispatch.use_triton("cpu")
        x = torch.randn(4, 64)
        dispatch.rms_norm(x, torch.ones(64), 1e-6)
        dispatch.add_rms_norm(x, x, torch.ones(64), 1e-6)
        dispatch.silu_and_mul(x)
        blocks = Q4Blocks(torch.randint(0, 16, (8, 64), dtype=torch.uint8), torch.rand(8, 2), torch.rand(8, 2), 32)
        dispatch.linear(x, dispatch.repack_q4(blocks, torch.float32))
        q8 = Q8Blocks(torch.randint(-127, 128, (8, 64), dtype=torch.int8), torch.rand(8, 2), 32)
        dispatch.linear(x, dispatch.repack_q8(q8))
        meta = dispatch.AttentionMetadata.build([1], [3], [[0]], [2])
        kc, vc = torch.randn(1, 4, 1, 16), torch.randn(1, 4, 1, 16)
        q = dispatch.rope_write_kv(torch.randn(1, 2, 16), torch.randn(1, 1, 16), torch.randn(1, 1, 16),
                                   torch.randn(1, 8), torch.randn(1, 8), kc, vc, meta.slot_mapping)
        dispatch.paged_attention(q, kc, vc, meta)
        with dispatch.force_backend("triton"):
            try:
                dispatch.silu_and_mul(x)
            except RuntimeError as e:
                assert "not installed" in str(e)
            else:
                raise AssertionError("forced triton without triton must raise")
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
