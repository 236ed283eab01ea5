"""Converter parity (issue 54), the MTP part: tiny random checkpoints made in transformers with the structural features
of the real configs, converted by llama.cpp's own convert_hf_to_gguf.py (the fixtures of tests/converter_fixtures.py).
Every case's logits against transformers', through its GGUF and its HF folder, are checked per registered
architecture in tests/models/test_registered_architectures.py.

Qwen3.5 checkpoints carry their MTP block as the real ones do; the converter keeps it by default (extra blocks,
`nextn_predict_layers`), and such a file must give the `--no-mtp` file's logits."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from converter_cases import BY_NAME, CASES  # noqa: E402
from converter_parity import load_ours, our_logits  # noqa: E402


# the served default's mean drift on these cases' tiny f32 files (measured 0.06-0.30): a bound that a broken path
# (wrong dtype, wrong pool) exceeds, not a precision claim
SERVED_MEAN_BOUND = 0.5


@pytest.mark.parametrize("name", ["llama", "gpt-oss", "gemma2", "qwen35"])
def test_served_default_runs_every_path(name: str, checkpoints, reference) -> None:
    """bf16 compute on the CPU (the default for BF16 and quantized files; asked for here on an f32 GGUF, which the
    default keeps at float32: tests/models/test_dtype_policy.py), the f16 KV pool with float32 queries and
    attention outputs, fused stack and per-op path alike: finite logits near transformers' (gpt-oss's dense bf16 o_proj
    with its bias takes the float32 attention output; Gemma 2's soft-capped attention reads the f16 pool on the
    torch path; Qwen3.5's gated attention)."""
    _, _, gguf = checkpoints(name)
    model = load_ours(gguf, dtype="bfloat16").model
    ref = reference(name)
    means = []
    for native in (False, None):  # False: the fused stack where the model takes it; None: the per-op path
        if hasattr(model, "_native"):
            model._native = native
        out = our_logits(model)
        assert torch.isfinite(out).all()
        means.append((out.log_softmax(-1) - ref.log_softmax(-1)).abs().amax(-1).mean().item())
    assert max(means) < SERVED_MEAN_BOUND, means


@pytest.mark.parametrize("name", [c.name for c in CASES if c.mtp_layers])
def test_mtp_gguf_gives_the_no_mtp_logits(name: str, checkpoints) -> None:
    """The converter's default file (MTP block appended, `nextn_predict_layers`) runs the same trunk as `--no-mtp`'s,
    and keeps the MTP block's tensors readable for MTP drafting."""
    from safetensors.torch import load_file

    from edgeserve.loaders.gguf_file import GGUFFile

    _, folder, with_mtp = checkpoints(name)
    _, _, without = checkpoints(name, "--no-mtp")
    a, b = load_ours(with_mtp), load_ours(without)
    layers = BY_NAME[name].config(8).get_text_config().num_hidden_layers
    assert (a.config.num_layers, a.config.mtp_layers) == (layers, BY_NAME[name].mtp_layers)
    assert (b.config.num_layers, b.config.mtp_layers) == (layers, 0)
    assert a.config.linear_layers == b.config.linear_layers
    assert torch.equal(our_logits(a.model), our_logits(b.model))
    gguf = GGUFFile(with_mtp)
    assert {f"blk.{layers}.nextn.eh_proj.weight", f"blk.{layers}.attn_q.weight"} <= set(gguf.tensor_names())
    fc = load_file(folder / "model.safetensors")["mtp.fc.weight"]  # the MTP head's weights, readable as stored
    assert torch.equal(gguf.load_tensor(f"blk.{layers}.nextn.eh_proj.weight"), fc)
    assert load_ours(folder).config.mtp_layers == BY_NAME[name].mtp_layers


@pytest.mark.parametrize("name", [c.name for c in CASES if c.mtp_layers])
def test_q8_0_mtp_gguf_serves_like_no_mtp(name: str, checkpoints) -> None:
    """The same at the serving dtype on a Q8_0 file (the fused native stack on a CPU)."""
    _, _, with_mtp = checkpoints(name, outtype="q8_0")
    _, _, without = checkpoints(name, "--no-mtp", outtype="q8_0")
    a, b = load_ours(with_mtp, dtype="auto"), load_ours(without, dtype="auto")
    assert a.config.mtp_layers == 1 and a.model.dtype != torch.float32
    assert torch.equal(our_logits(a.model), our_logits(b.model))
