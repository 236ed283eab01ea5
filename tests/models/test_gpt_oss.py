"""gpt-oss on a tiny random GptOssForCausalLM (float32: 4 layers, 4 experts top-2, a sliding window of 4 on the even
layers, YaRN, attention sinks, biases everywhere) written here as HF safetensors and as a llama.cpp-named GGUF: our
logits against transformers' through prefill and decode past the window, contiguous and paged; MXFP4 experts on the
native kernels; and through the engine: greedy outputs the same batched or alone, chunked or whole."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.cpu.decoder import NativeDecoder
from edgeserve.kernels.formats.experts import BlockExperts, DenseExperts
from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.loaders.hf_folder import HFFolder
from edgeserve.models.config import config_from_gguf, config_from_hf
from edgeserve.models.decoders import decoder_class
from edgeserve.models.archs.gpt_oss.model import GptOssModel

from support import logit_runs
from support.engine_checks import assert_batch_and_chunk_invariant
from support.gguf_vocab import byte_vocab
from support.gguf_writer import matrices, write_model_gguf
from support.model_sources import gguf_source, saved_source

transformers = pytest.importorskip("transformers")

TOKENS = ["<|endoftext|>", "<|start|>", "<|end|>"] + byte_vocab() + ["he", "ll", "hell"]
VOCAB, HIDDEN, EXPERTS, TOP_K, FFN, LAYERS, WINDOW = len(TOKENS), 64, 4, 2, 32, 4, 4
PROMPT = [1, 5, 17, 33, 2, 60, 7, 81, 100, 12, 250]
DECODES = 5
YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096, "rope_theta": 150000.0}


def hf_gpt_oss():
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
        sliding_window=WINDOW, max_position_embeddings=256, rms_norm_eps=1e-5, rope_parameters=dict(YARN),
        tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():  # bigger than the default init, so routing, sinks and the clamps all matter
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5 if "norm" in name or "router" in name else (1.0 if "sinks" in name else 0.15))
    return model


def write_gpt_oss_gguf(model, path: Path, expert_qtype: str = "F32", matrix_qtype: str = "F32") -> Path:
    """The model as llama.cpp's converter writes a gpt-oss GGUF (experts split and de-interleaved into 3-D
    ffn_{gate,up,down}_exps with biases, the router as ffn_gate_inp, sinks as attn_sinks, YaRN and the window as
    metadata), with the tests' byte-level tokenizer; experts as `expert_qtype`, other matrices as `matrix_qtype`."""
    return write_model_gguf(model, path, qtype=matrices(matrix_qtype, expert_qtype), pre="gpt-4o")


def load_ours(source: str, model, tmp_path: Path, dtype: torch.dtype = torch.float32, **gguf_types) -> GptOssModel:
    if source == "safetensors":
        config, weights = saved_source(model, tmp_path / "hf")
    else:
        config, weights = gguf_source(write_gpt_oss_gguf(model, tmp_path / "m.gguf", **gguf_types))
    assert config.architecture == "gpt-oss" and decoder_class(config) is GptOssModel
    got = decoder_class(config).from_weights(config, weights, dtype=dtype)
    assert isinstance(got, GptOssModel)
    return got


def contiguous_logits(model) -> torch.Tensor:
    """Prefill PROMPT, then decode DECODES tokens one at a time."""
    return logit_runs.contiguous_logits(model, PROMPT, DECODES)


def paged_logits(model, block_size: int = 4) -> torch.Tensor:
    """The same through a paged pool: the prompt in two chunks, then single-token decode steps."""
    return logit_runs.paged_logits(model, PROMPT, DECODES, block_size)


def reference_logits(model) -> torch.Tensor:
    ids = PROMPT + list(range(40, 40 + DECODES))
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_config_from_hf_and_gguf(tmp_path: Path) -> None:
    model = hf_gpt_oss()
    hf = config_from_hf(json.loads(model.config.to_json_string()))
    g = GGUFFile(write_gpt_oss_gguf(model, tmp_path / "m.gguf"))
    gg = config_from_gguf(g.metadata, set(g.tensor_names()))
    for c in (hf, gg):
        assert (c.architecture, c.num_experts, c.experts_per_token, c.moe_intermediate_size) == \
            ("gpt-oss", EXPERTS, TOP_K, FFN)
        assert c.layer_windows == (WINDOW, None, WINDOW, None)  # sliding on the even layers
        assert c.attention_bias and not c.qk_norm and c.sliding_window is None and not c.norm_topk_prob
        assert c.rope_scaling is not None and c.rope_scaling.kind == "yarn" and not c.rope_scaling.truncate
        assert (c.rope_scaling.factor, c.rope_scaling.original_max_position_embeddings) == (32.0, 4096)


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_logits_match_transformers(source: str, tmp_path: Path) -> None:
    ref_model = hf_gpt_oss()
    ref = reference_logits(ref_model)
    model = load_ours(source, ref_model, tmp_path)
    assert all(isinstance(layer.moe.gate_up, DenseExperts) for layer in model.layers)  # float32: exact path
    assert NativeDecoder.build(model) is None  # the fused stack declines it cleanly
    for got in (contiguous_logits(model), paged_logits(model)):
        assert got.shape == ref.shape
        diff = (got - ref).abs().max().item()
        assert diff < 1e-4 * max(1.0, ref.abs().max().item()), f"{source}: max diff {diff}"


def test_each_gpt_oss_part_changes_the_logits(tmp_path: Path) -> None:
    """The window, the sinks and the o_proj biases each matter at these lengths (so the match above tests them)."""
    ref_model = hf_gpt_oss()
    model = load_ours("safetensors", ref_model, tmp_path)
    base = contiguous_logits(model)
    windows = model.config.layer_windows
    object.__setattr__(model.config, "layer_windows", (None,) * LAYERS)
    assert (contiguous_logits(model) - base).abs().max() > 1e-2
    object.__setattr__(model.config, "layer_windows", windows)
    sinks, model.sinks = model.sinks, [torch.full_like(s, float("-inf")) for s in model.sinks]
    assert (contiguous_logits(model) - base).abs().max() > 1e-2
    model.sinks, biases = sinks, model.o_biases
    model.o_biases = [torch.zeros_like(b) for b in biases]
    assert (contiguous_logits(model) - base).abs().max() > 1e-2


native = pytest.mark.skipif(not cpu_native.available(), reason="native CPU kernels not built")


@native
def test_mxfp4_experts_run_natively(tmp_path: Path) -> None:
    """A GGUF with MXFP4 experts (gpt-oss's own format) loaded in bfloat16 keeps them as block bytes on the native
    kernels; its logits stay close to transformers' float32 ones."""
    if "MXFP4" not in cpu_native.FORMATS:
        pytest.skip("MXFP4 not in this build")
    ref_model = hf_gpt_oss()
    model = load_ours("gguf", ref_model, tmp_path, torch.bfloat16, expert_qtype="MXFP4", matrix_qtype="Q8_0")
    assert all(isinstance(layer.moe.gate_up, BlockExperts) for layer in model.layers)
    # experts this small (well under half the memory) are copied into the kernels' bands, as Qwen3 MoE's are
    assert [p.qtype for p in model.layers[0].moe.gate_up.parts] == ["MXFP4_X8", "MXFP4_X8"]
    assert isinstance(NativeDecoder.build(model), NativeDecoder)  # bfloat16 with block weights: the fused stack
    got, want = paged_logits(model).float(), reference_logits(ref_model)
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.98


@native
def test_engine_outputs_do_not_depend_on_batching_or_chunking(tmp_path: Path) -> None:
    from edgeserve.llm import LLM

    path = write_gpt_oss_gguf(hf_gpt_oss(), tmp_path / "g.gguf", expert_qtype="Q8_0", matrix_qtype="Q8_0")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (5, 23, 40, 71)]
    llm = LLM(str(path), dtype="bfloat16", device="cpu", kv_cache_gb=0.01, enable_prefix_caching=False)
    assert isinstance(llm.lm.model, GptOssModel)
    assert_batch_and_chunk_invariant(llm, prompts)


def write_mxfp4_checkpoint(model, folder: Path, exponents: tuple[int, int] = (121, 125)) -> None:
    """Save `model` as OpenAI's checkpoints are laid out: experts as MXFP4 `*_blocks` / `*_scales` (random codes and
    exponents here, the scales' biased exponents drawn from [exponents[0], exponents[1])) with quantization_config
    mxfp4, and set the model's experts to those blocks' values (transformers' own dequantization), so it is the
    reference for what the checkpoint holds."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model.save_pretrained(folder)
    file = folder / "model.safetensors"
    sd = load_file(str(file))
    g = torch.Generator().manual_seed(5)
    for i in range(model.config.num_hidden_layers):
        experts = model.model.layers[i].mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(experts, name)  # [E, in, out]
            e, cols, rows = param.shape
            blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(*exponents, (e, rows, cols // 32), generator=g, dtype=torch.uint8)
            key = f"model.layers.{i}.mlp.experts.{name}"
            del sd[key]
            sd[key + "_blocks"], sd[key + "_scales"] = blocks, scales
            with torch.no_grad():
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(sd, str(file), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_mxfp4_experts(dtype: torch.dtype, tmp_path: Path) -> None:
    """OpenAI's MXFP4 safetensors: float32 dequantizes the experts (logits as transformers' on the same values);
    bfloat16 on the native kernels keeps them as MXFP4 blocks, close to the float32 load."""
    ref_model = hf_gpt_oss()
    write_mxfp4_checkpoint(ref_model, tmp_path / "hf")
    config = config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    model = GptOssModel.from_weights(config, HFFolder(tmp_path / "hf").weights(), dtype=dtype)
    got = paged_logits(model).float()
    ref = reference_logits(ref_model)
    if dtype == torch.float32:
        assert isinstance(model.layers[0].moe.gate_up, DenseExperts)
        diff = (got - ref).abs().max().item()
        assert diff < 1e-4 * max(1.0, ref.abs().max().item()), f"max diff {diff}"
    else:
        if not cpu_native.available():
            pytest.skip("native CPU kernels not built")
        assert all(isinstance(layer.moe.gate_up, BlockExperts) for layer in model.layers)
        assert torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0) > 0.98


def test_dummy_load_format_builds_gpt_oss(tmp_path: Path) -> None:
    """`--load-format dummy` on a gpt-oss config.json builds the gpt-oss decoder (sinks, biases, MoE) and generates."""
    from edgeserve.llm import LLM
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve
    from edgeserve.sampling_params import SamplingParams

    (tmp_path / "config.json").write_text(hf_gpt_oss().config.to_json_string())
    lm = load_model(resolve(str(tmp_path)), dtype="float32", device="cpu", load_format="dummy")
    assert isinstance(lm.model, GptOssModel) and len(lm.model.sinks) == LAYERS
    out = LLM.from_model(lm, kv_cache_gb=0.01).generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
