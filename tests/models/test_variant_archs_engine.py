"""Issue 33's variants through the engine (paged pool, scheduler, chunked prefill, batched decode): OLMo 3's sliding
layers in their own window pool or in the one pool of all layers give transformers' greedy tokens; SmolLM3 on the
fused native stack gives the per-op path's tokens."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.loaders.hf_folder import HFFolder
from edgeserve.models.config import config_from_hf
from edgeserve.models.decoders import decoder_class
from edgeserve.models.load import LoadedModel

pytest.importorskip("transformers")
from test_cpu_decoder import _native_on  # noqa: E402,F401  (the fixture keeps the kernels on)
from test_variant_archs import hf_model  # noqa: E402
from test_variant_archs_native import q8_model  # noqa: E402
from test_window_blocks import engine, generate  # noqa: E402

PROMPTS = [[(7 * i + 3) % 96 for i in range(23)], [(5 * i + 11) % 96 for i in range(13)]]
TOKENS = 24


def loaded(model, tmp_path: Path) -> LoadedModel:
    tokenizer = SimpleNamespace(eot_ids=frozenset(), decode=lambda ids: "", byte_fallback_ids=frozenset())
    return LoadedModel("tiny", SimpleNamespace(path=tmp_path), model.config, model, tokenizer, None, 0.0)


@pytest.mark.parametrize("window_pool", [True, False])
def test_olmo3_engine_gives_transformers_greedy_tokens(tmp_path: Path, monkeypatch, window_pool: bool) -> None:
    ref_model = hf_model("olmo3")
    with torch.no_grad():
        want = [ref_model.generate(torch.tensor([p]), max_new_tokens=TOKENS, do_sample=False, min_new_tokens=TOKENS)
                [0, len(p):].tolist() for p in PROMPTS]
    ref_model.save_pretrained(tmp_path / "hf")
    folder = HFFolder(tmp_path / "hf")
    config = config_from_hf(folder.config)
    model = decoder_class(config).from_weights(config, folder.weights(), dtype=torch.float32)
    got = generate(engine(loaded(model, tmp_path), window_pool, monkeypatch, enable_prefix_caching=False),
                   PROMPTS, TOKENS)
    assert got == want


@pytest.mark.skipif(not cpu_native.available(), reason="no native CPU kernels here")
def test_smollm3_engine_tokens_are_the_same_fused_and_per_op(tmp_path: Path, monkeypatch) -> None:
    model = q8_model("smollm3", tmp_path / "m.gguf")
    outputs = []
    for fused in (True, False):
        model._native = False if fused else None
        outputs.append(generate(engine(loaded(model, tmp_path), False, monkeypatch, enable_prefix_caching=False),
                                PROMPTS, TOKENS))
        assert (model._native is not None) == fused
    assert outputs[0] == outputs[1]
    assert len(set(outputs[0][0])) > 3  # not a degenerate repetition


@pytest.mark.parametrize("arch", ["smollm3", "mistral3", "granite"])
def test_a_variant_gguf_generates_through_the_llm_api(arch: str, tmp_path: Path) -> None:
    """A complete GGUF (tokenizer included) of the Llama-shaped variants loads by path and generates."""
    from tiny_gguf import write_tiny_llama

    from edgeserve.llm import LLM
    from edgeserve.sampling_params import SamplingParams

    llm = LLM(str(write_tiny_llama(tmp_path / f"{arch}.gguf", arch=arch, layers=4)), device="cpu")
    assert llm.lm.config.architecture == arch
    if arch == "smollm3":
        assert llm.lm.config.rope_layers == (True, True, True, False)
    out = llm.generate(["hello"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8


def test_an_olmo2_gguf_without_its_norms_is_one_clear_error(tmp_path: Path) -> None:
    from test_cli import assert_one_line_error, edgeserve
    from tiny_gguf import write_tiny_llama

    path = write_tiny_llama(tmp_path / "olmo2.gguf", arch="olmo2")  # Llama's tensors: no Q/K or post norms
    assert_one_line_error(edgeserve("run", str(path), "hi"), "blk.0.attn_q_norm.weight")
