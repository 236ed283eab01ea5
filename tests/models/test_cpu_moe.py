"""--cpu-moe-layers (issue 37 item 5): the experts of the first N MoE layers in host memory, in block format, on the
native CPU kernels, the rest of the model on its device.

Without a GPU the split runs with a CUDA stand-in: the model's part in float32 torch on the CPU (where the plain
load dequantizes the experts to dense tensors) and the host layers' experts kept as GGUF blocks on the native
kernels, through MoELayer's host path (routed rows handed to the host, the sum handed back, the shared expert
beside it). Logits of tiny random Qwen3 MoE and gpt-oss models match the plain load's for N = 1 and all. A
GPU-marked test runs the real split on CUDA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edgeserve.errors import EdgeserveError
from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.formats.experts import BlockExperts, DenseExperts
from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.loaders.gguf_weights import GGUFWeights
from edgeserve.models import moe as moe_module
from edgeserve.models.config import config_from_gguf
from edgeserve.models.cpu_moe import host_expert_layers, host_experts, parse_cpu_moe_layers
from edgeserve.models.decoders import decoder_class

import test_gpt_oss
import test_qwen3_moe
from tiny_gguf import write_tiny_llama

native = pytest.mark.skipif(not cpu_native.available(), reason="native CPU kernels not built")
# each model's (random HF model, GGUF writer, paged logits of its steps, number of those steps, expert block format)
MODELS = {"qwen3moe": (test_qwen3_moe.hf_moe, test_qwen3_moe.write_moe_gguf, test_qwen3_moe.paged_logits,
                       2 + test_qwen3_moe.DECODES, "Q8_0"),
          "gpt-oss": (test_gpt_oss.hf_gpt_oss, test_gpt_oss.write_gpt_oss_gguf, test_gpt_oss.paged_logits,
                      2 + test_gpt_oss.DECODES, "Q8_0")}


def gguf_model(path: Path, dtype: torch.dtype, device: str = "cpu", host_layers: int = 0):
    """The GGUF at `path` loaded in `dtype` on `device`, the experts of its first `host_layers` MoE layers on the
    host (the placement load_model opens for --cpu-moe-layers)."""
    g = GGUFFile(path)
    config = config_from_gguf(g.metadata, set(g.tensor_names()))
    with host_experts(host_layers):
        return decoder_class(config).from_weights(config, GGUFWeights(g, config.num_heads, config.num_kv_heads),
                                                  dtype=dtype, device=torch.device(device))


@pytest.fixture
def host_path_calls(monkeypatch) -> list[int]:
    """Rows each call of MoELayer's host path handed to the host."""
    calls: list[int] = []
    original = moe_module.MoELayer._mix_on_host

    def spy(self, h, weights, experts):
        calls.append(h.shape[0])
        return original(self, h, weights, experts)

    monkeypatch.setattr(moe_module.MoELayer, "_mix_on_host", spy)
    return calls


@native
@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("layers", ["1", "all"])
def test_host_experts_match_the_plain_run(arch: str, layers: str, tmp_path: Path, monkeypatch,
                                          host_path_calls: list[int]) -> None:
    """The stand-in split: float32 torch for the model, the host layers' Q8_0 experts as blocks on the native
    kernels; logits equal the plain float32 load's (experts dequantized, all torch) within float tolerance."""
    monkeypatch.setenv("EDGESERVE_MOE_REPACK", "0")
    build, write, logits, steps, qtype = MODELS[arch]
    path = write(build(), tmp_path / "m.gguf", expert_qtype=qtype)
    plain = gguf_model(path, torch.float32)
    n = host_expert_layers(layers, plain.config)
    assert n == (1 if layers == "1" else plain.config.num_layers)
    split = gguf_model(path, torch.float32, host_layers=n)
    for i, layer in enumerate(split.layers):
        for experts in (layer.moe.gate_up, layer.moe.down):
            if i < n:  # on the host, in block format (a view of the file's bytes, not a dense copy)
                assert isinstance(experts, BlockExperts) and [p.qtype for p in experts.parts] == [qtype] * len(
                    experts.parts)
            else:
                assert isinstance(experts, DenseExperts)
        assert layer.moe.experts_on_host == (i < n)
        assert isinstance(plain.layers[i].moe.gate_up, DenseExperts) and not plain.layers[i].moe.experts_on_host
    want = logits(plain)
    got = logits(split)
    assert len(host_path_calls) == n * steps  # every step of paged_logits goes through each host layer's split
    assert want.abs().max() > 0.5
    torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=0)
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.9995
    for layer in split.layers:  # the same block-format experts without the split: the split itself changes nothing
        layer.moe.experts_on_host = False
    torch.testing.assert_close(got, logits(split), atol=1e-5, rtol=1e-5)


def test_host_path_adds_the_shared_expert_and_biases() -> None:
    """MoELayer's host path on a layer with a gated shared expert and expert biases: the same output as the
    direct path (the routed sum back from the host, the shared expert computed beside it)."""
    from edgeserve.models.moe import MoEConfig, MoELayer, SharedExpert

    torch.manual_seed(0)
    e, f, hidden, t = 4, 8, 16, 5
    layer = MoELayer(MoEConfig(e, 2, f, normalize_topk=True), torch.randn(e, hidden),
                     DenseExperts(torch.randn(e, 2 * f, hidden)), DenseExperts(torch.randn(e, hidden, f)),
                     gate_up_bias=torch.randn(e, 2 * f), down_bias=torch.randn(e, hidden),
                     shared=SharedExpert(torch.randn(2 * f, hidden), torch.randn(hidden, f), torch.randn(1, hidden)))
    h = torch.randn(t, hidden)
    want = layer.forward(h)
    layer.experts_on_host = True
    torch.testing.assert_close(layer.forward(h), want, atol=1e-6, rtol=1e-6)
    layer.shared = None
    assert (layer.forward(h) - want).abs().max() > 1e-2


def test_bad_values_are_refused_naming_the_flag() -> None:
    config = test_qwen3_moe.config_from_hf(test_qwen3_moe.model_dict())
    assert parse_cpu_moe_layers("all") == "all" and parse_cpu_moe_layers("0") is None
    assert host_expert_layers(2, config) == 2 and host_expert_layers(None, config) == 0
    for bad in (-1, "-3", "two", "1.5", 1.5, True):
        with pytest.raises(ValueError, match="^--cpu-moe-layers must be a non-negative integer or 'all'"):
            parse_cpu_moe_layers(bad)
    with pytest.raises(EdgeserveError, match="^--cpu-moe-layers 3 is more than the model's 2 MoE layers$"):
        host_expert_layers(3, config)
    dense = test_qwen3_moe.config_from_hf({**test_qwen3_moe.model_dict(), "model_type": "qwen3", "num_experts": 0,
                                          "num_local_experts": 0})
    with pytest.raises(EdgeserveError, match="^--cpu-moe-layers: qwen3 has no experts"):
        host_expert_layers("all", dense)


def test_cli_and_server_config_refuse_bad_values(capsys) -> None:
    from edgeserve.cli import main
    from edgeserve.server.config import ServerConfig

    for bad in ("-1", "x"):
        with pytest.raises(SystemExit) as e:
            main(["run", "--cpu-moe-layers", bad, "m"])
        assert e.value.code != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--cpu-moe-layers" in err[0]
    from edgeserve.cli import build_parser, server_config_from_args

    args = build_parser().parse_args(["serve", "--device", "cpu", "--cpu-moe-layers", "all"])
    assert server_config_from_args(args).cpu_moe_layers == "all"
    assert build_parser().parse_args(["run", "--cpu-moe-layers", "3", "m"]).cpu_moe_layers == 3
    assert ServerConfig(cpu_moe_layers="all").cpu_moe_layers == "all"
    with pytest.raises(ValueError, match="cpu_moe_layers .* \\(flag --cpu-moe-layers\\)"):
        ServerConfig(cpu_moe_layers=-1)


@native
def test_load_model_refuses_dense_models_and_is_a_no_op_on_cpu(tmp_path: Path, caplog) -> None:
    """load_model: a model without experts is refused in one line; on a CPU the flag keeps every expert where a
    plain CPU load does (said in the log)."""
    from edgeserve.models.load import load_model
    from edgeserve.registry.resolve import ModelSource
    from tiny_gguf import write_tiny_llama

    path = test_qwen3_moe.write_moe_gguf(test_qwen3_moe.hf_moe(), tmp_path / "m.gguf", expert_qtype="Q8_0")
    with caplog.at_level("INFO"):
        lm = load_model(ModelSource("m", "gguf", path), dtype="bfloat16", device="cpu", cpu_moe_layers="all")
    assert not any(layer.moe.experts_on_host for layer in lm.model.layers)
    assert "changes nothing on a CPU run" in caplog.text
    with pytest.raises(EdgeserveError, match="more than the model's 2 MoE layers"):
        load_model(ModelSource("m", "gguf", path), dtype="bfloat16", device="cpu", cpu_moe_layers=5)
    dense = write_tiny_llama(tmp_path / "dense.gguf")
    with pytest.raises(EdgeserveError, match="^--cpu-moe-layers: llama has no experts"):
        load_model(ModelSource("d", "gguf", dense), dtype="bfloat16", device="cpu", cpu_moe_layers=1)


@pytest.mark.gpu
@native
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_real_split_on_cuda(arch: str, tmp_path: Path, host_path_calls: list[int]) -> None:
    """On a GPU, through the engine: attention, router and the rest on CUDA, the experts of every MoE layer on the
    host in block format; greedy outputs the same batched or alone, and the first token as the all-GPU load's."""
    from edgeserve.llm import LLM
    from edgeserve.sampling_params import SamplingParams

    build, write, _, _, qtype = MODELS[arch]
    path = write(build(), tmp_path / "m.gguf", expert_qtype=qtype)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[1, 5, 17, 33, 2, 60, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]]
    on_gpu = LLM(str(path), dtype="float32", device="cuda", kv_cache_gb=0.05, enable_prefix_caching=False)
    split = LLM(str(path), dtype="float32", device="cuda", kv_cache_gb=0.05, enable_prefix_caching=False,
                cpu_moe_layers="all")
    for layer in split.lm.model.layers:
        assert layer.moe.router.device.type == "cuda" and layer.moe.experts_on_host
        assert isinstance(layer.moe.gate_up, BlockExperts) and isinstance(layer.moe.down, BlockExperts)
    together = [r.outputs[0].token_ids for r in split.generate(prompts, greedy)]
    assert host_path_calls
    assert together == [split.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]
    want = [r.outputs[0].token_ids for r in on_gpu.generate(prompts, greedy)]
    assert [t[0] for t in together] == [t[0] for t in want]


def test_fit_check_counts_host_experts_as_host_memory(tmp_path: Path, monkeypatch) -> None:
    """The server's 507 check on a (stand-in) GPU: with --cpu-moe-layers the host layers' expert bytes leave the
    device's weights and are checked against free host memory."""
    from types import SimpleNamespace

    import psutil

    from edgeserve import device as device_module
    from edgeserve.registry.resolve import ModelSource
    from edgeserve.server.config import ServerConfig
    from edgeserve.server.model_manager import estimate_memory

    path = test_qwen3_moe.write_moe_gguf(test_qwen3_moe.hf_moe(), tmp_path / "m.gguf", expert_qtype="Q8_0")
    g = GGUFFile(path)
    layer0 = sum(g.tensor_info(n).n_bytes for n in g.tensor_names() if n.startswith("blk.0.") and "_exps" in n)
    assert layer0 > 0
    monkeypatch.setattr(device_module, "resolve_device", lambda d: torch.device("cuda"))
    monkeypatch.setattr(device_module, "resolve_dtype", lambda d, dev: torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (10**9, 2 * 10**9))
    free_host = SimpleNamespace(available=10**9, total=2 * 10**9)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: free_host)
    source = ModelSource("m", "gguf", path)
    plain = estimate_memory(source, ServerConfig(device="cuda"))
    one = estimate_memory(source, ServerConfig(device="cuda", cpu_moe_layers=1))
    every = estimate_memory(source, ServerConfig(device="cuda", cpu_moe_layers="all"))
    assert plain.host_experts == 0 and one.host_experts == layer0 and every.host_experts == 2 * layer0
    assert plain.weights - one.weights == layer0 and plain.weights - every.weights == 2 * layer0
    assert every.fits
    free_host.available = layer0  # the experts of both layers no longer fit in host memory
    tight = estimate_memory(source, ServerConfig(device="cuda", cpu_moe_layers="all"))
    assert not tight.fits and "in host memory (--cpu-moe-layers)" in tight.describe()
    with pytest.raises(EdgeserveError, match="more than the model's 2 MoE layers"):
        estimate_memory(source, ServerConfig(device="cuda", cpu_moe_layers=3))


@native
def test_engine_runs_the_split_model(tmp_path: Path, host_path_calls: list[int]) -> None:
    """The stand-in split model (every MoE layer's experts on the host) through the engine (pool sizing, batching,
    chunked steps): greedy outputs the same batched or alone."""
    from edgeserve.llm import LLM
    from edgeserve.models.dummy import dummy_chat_template, dummy_tokenizer
    from edgeserve.models.load import LoadedModel
    from edgeserve.registry.resolve import ModelSource
    from edgeserve.sampling_params import SamplingParams

    path = test_qwen3_moe.write_moe_gguf(test_qwen3_moe.hf_moe(), tmp_path / "m.gguf", expert_qtype="Q8_0")

    def llm(host_layers: int) -> LLM:
        model = gguf_model(path, torch.float32, host_layers=host_layers)
        assert all(layer.moe.experts_on_host for layer in model.layers)
        lm = LoadedModel("m", ModelSource("m", "gguf", path), model.config, model,
                         dummy_tokenizer(model.config.vocab_size), dummy_chat_template(), 0.0)
        return LLM.from_model(lm, kv_cache_gb=0.01, enable_prefix_caching=False)

    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[1, 5, 17, 33, 2, 60, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52], [9, 8]]
    split = llm(2)
    together = [r.outputs[0].token_ids for r in split.generate(prompts, greedy)]
    assert host_path_calls and all(len(t) == 6 for t in together)
    assert together == [split.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]


def test_run_hands_the_flag_to_the_load(tmp_path: Path, monkeypatch, capsys) -> None:
    """`edgeserve run --cpu-moe-layers 1` loads with cpu_moe_layers=1 (the load itself is stopped here)."""
    from edgeserve import llm as llm_module
    from edgeserve.cli import main

    seen = {}

    def fake_llm(model, **options):
        seen.update(options)
        raise EdgeserveError("stop here")

    monkeypatch.setattr(llm_module, "LLM", fake_llm)
    path = write_tiny_llama(tmp_path / "m.gguf")  # a real file: `run` checks the model before it loads
    assert main(["run", "--device", "cpu", "--cpu-moe-layers", "1", str(path), "hi"]) != 0
    assert seen["load"].cpu_moe_layers == 1 and "stop here" in capsys.readouterr().err
