"""Gemma 4 12B (HF `gemma4_unified`, edgeserve.models.archs.gemma4_unified) beyond the parity of
tests/models/test_registered_architectures.py: its config read under its own defaults (no per-layer inputs), its 12B
layer kinds together (V = K global layers, KV-shared layers with a double-wide MLP) in the fused native stack bit for bit
as the per-op path on llama.cpp's converter's Q8_0 GGUF, and Gemma 4's chat format from its template."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from converter_parity import load_ours  # noqa: E402
from test_cpu_decoder import STEPS, _native_on, run_steps  # noqa: E402,F401  (the fixture keeps the kernels on)

from edgeserve.errors import UnsupportedModelError  # noqa: E402
from edgeserve.kernels.cpu import native as cpu_native  # noqa: E402
from edgeserve.kernels.cpu.decoder import NativeDecoder  # noqa: E402
from edgeserve.kernels.cpu.native import BlockWeight  # noqa: E402
from edgeserve.models.config import config_from_hf  # noqa: E402

CASE = "gemma4-12b"  # tests/converter_cases.py


def unified_config(**text) -> dict:
    """A gemma4_unified config.json dict with a small text model (every other key at transformers' defaults)."""
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4, head_dim=16,
                num_kv_shared_layers=2, use_double_wide_mlp=True, attention_k_eq_v=True,
                per_layer_config={"5": {"head_dim": 32, "num_key_value_heads": 1}})
    return {"model_type": "gemma4_unified", "architectures": ["Gemma4UnifiedForConditionalGeneration"],
            "tie_word_embeddings": True, "text_config": {"model_type": "gemma4_unified_text", **base, **text}}


def test_config_reads_the_unified_defaults() -> None:
    c = config_from_hf(unified_config())
    assert c.architecture == "gemma4_unified"
    assert c.per_layer_input_size == 0  # Gemma 4's text config would mean 256-wide per-layer inputs
    assert c.layer_windows == (1024,) * 5 + (None,) and c.num_kv_heads == 4  # the unified config's own defaults
    assert (c.global_head_dim, c.global_kv_heads, c.global_k_eq_v) == (32, 1, True)
    assert c.kv_shared_layers == 2 and c.layer_intermediate == (96,) * 4 + (192,) * 2
    assert c.tie_word_embeddings


def test_bidirectional_text_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention"):
        config_from_hf(unified_config(use_bidirectional_attention="all"))


@pytest.mark.skipif(not cpu_native.available(), reason="no native CPU kernels here")
def test_q8_0_gguf_fused_stack_equals_the_per_op_path(checkpoints) -> None:
    _, _, gguf = checkpoints(CASE, outtype="q8_0")
    model = load_ours(gguf, dtype="bfloat16").model
    c = model.config
    assert c.global_k_eq_v and c.kv_shared_layers == 3 and not c.per_layer_input_size
    assert {layer.gate_up.shape[0] // 2 for layer in model.layers if layer.shared} == {2 * c.intermediate_size}
    assert any(layer.shared and layer.window is None for layer in model.layers)  # reads a V = K layer's K/V
    assert all(isinstance(m, BlockWeight) for layer in model.layers for m in (layer.qkv, layer.gate_up, layer.down))
    assert isinstance(model.native_decoder(), NativeDecoder)
    fused, fused_pool = run_steps(model, True, STEPS)  # up to 42 positions: far past the window of 5
    per_op, per_op_pool = run_steps(model, False, STEPS)
    for step, (a, b) in enumerate(zip(fused, per_op)):
        assert torch.equal(a, b), f"step {step}: max diff {(a.float() - b.float()).abs().max().item()}"
    for name in ("k", "v", "window_k", "window_v"):
        assert torch.equal(getattr(fused_pool, name), getattr(per_op_pool, name)), name


@pytest.mark.parametrize("form", ["gguf", "folder"])
def test_chat_template_gives_gemma4_format(form: str, checkpoints) -> None:
    from edgeserve.server.chat_setup import chat_setup
    from edgeserve.server.request import GenerationRequest

    _, folder, gguf = checkpoints(CASE)
    lm = load_ours(gguf if form == "gguf" else folder)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    req = GenerationRequest(model="m", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
                            tool_choice="auto")
    setup = chat_setup(req, lm.chat_template)
    assert setup.tools.format.name == "gemma4"
    assert "<|turn>user\nWeather in Paris?<turn|>\n<|turn>model\n" in setup.prompt
    assert "<|tool>declaration:get_weather" in setup.prompt
