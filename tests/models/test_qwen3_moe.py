"""Qwen3 MoE on a tiny random Qwen3MoeForCausalLM written here as HF safetensors (per-expert and fused expert
names) and as GGUF (float32, and Q8_0 / Q4_0 experts kept in block format): our logits against transformers'
through prefill and decode, and through the engine: greedy outputs the same batched or alone, chunked or whole."""

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
from edgeserve.loaders.gguf_weights import GGUFWeights
from edgeserve.models.config import config_from_gguf, config_from_hf
from edgeserve.models.decoders import decoder_class
from edgeserve.models.archs.qwen3moe.model import MoEModel

from support import logit_runs
from support.engine_checks import assert_batch_and_chunk_invariant
from support.gguf_vocab import TOKENS
from support.gguf_writer import finish, matrices, write_model_gguf
from support.model_sources import folder_source, gguf_source

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, EXPERTS, TOP_K, EXPERT_FFN = len(TOKENS), 64, 8, 2, 32
PROMPT = [1, 5, 17, 33, 2, 60, 7, 81, 100, 12, 250]
DECODES = 5


def hf_moe():
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=EXPERT_FFN,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, norm_topk_prob=True, max_position_embeddings=128, rms_norm_eps=1e-6,
        tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # bigger than the default init, so routing and attention are far from uniform
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5 if "norm" in name else (0.5 if "mlp.gate" in name else 0.15))
    return model


def write_moe_gguf(model, path: Path, expert_qtype: str = "F32", matrix_qtype: str = "F32") -> Path:
    """The model as llama.cpp's converter writes a qwen3moe GGUF (experts as 3-D ffn_{gate,up,down}_exps), with the
    tests' byte-level tokenizer; experts stored as `expert_qtype`, the other matrices as `matrix_qtype`."""
    return write_model_gguf(model, path, qtype=matrices(matrix_qtype, expert_qtype), pre="qwen2")


def fuse_experts(folder: Path) -> None:
    """Rewrite a saved folder's per-expert tensors as transformers 5's fused mlp.experts.gate_up_proj /
    down_proj (the layout newer checkpoints use)."""
    from safetensors.torch import load_file, save_file

    file = folder / "model.safetensors"
    sd = load_file(str(file))
    layers = {k.split(".")[2] for k in sd if ".experts." in k}
    for i in layers:
        p = f"model.layers.{i}.mlp.experts."
        sd[p + "gate_up_proj"] = torch.stack(
            [torch.cat([sd.pop(f"{p}{e}.gate_proj.weight"), sd.pop(f"{p}{e}.up_proj.weight")]) for e in range(EXPERTS)])
        sd[p + "down_proj"] = torch.stack([sd.pop(f"{p}{e}.down_proj.weight") for e in range(EXPERTS)])
    save_file(sd, str(file), metadata={"format": "pt"})


def load_ours(source: str, model, tmp_path: Path, dtype: torch.dtype = torch.float32, **gguf_types):
    if source.startswith("safetensors"):
        model.save_pretrained(tmp_path / "hf")
        if source == "safetensors-fused":
            fuse_experts(tmp_path / "hf")
        config, weights = folder_source(tmp_path / "hf")
    else:
        config, weights = gguf_source(write_moe_gguf(model, tmp_path / "m.gguf", **gguf_types))
    assert config.architecture == "qwen3moe" and decoder_class(config) is MoEModel
    return decoder_class(config).from_weights(config, weights, dtype=dtype)


def contiguous_logits(model) -> torch.Tensor:
    """Prefill PROMPT, then decode DECODES tokens one at a time."""
    return logit_runs.contiguous_logits(model, PROMPT, DECODES)


def paged_logits(model, block_size: int = 4) -> torch.Tensor:
    """The same through a paged pool: the prompt in two chunks, then single-token decode steps."""
    return logit_runs.paged_logits(model, PROMPT, DECODES, block_size)


def test_config_reads_the_moe_fields(tmp_path: Path) -> None:
    model = hf_moe()
    hf = config_from_hf(model.config.to_dict())
    g = GGUFFile(write_moe_gguf(model, tmp_path / "m.gguf"))
    gg = config_from_gguf(g.metadata, set(g.tensor_names()))
    for c in (hf, gg):
        assert (c.architecture, c.num_experts, c.experts_per_token, c.moe_intermediate_size) == \
            ("qwen3moe", EXPERTS, TOP_K, EXPERT_FFN)
        assert c.norm_topk_prob and c.qk_norm and c.is_moe
    saved = {**model.config.to_dict(), "num_experts": None, "num_local_experts": EXPERTS}  # as save_pretrained writes
    assert config_from_hf(saved).num_experts == EXPERTS


def test_experts_in_other_architectures_are_refused_by_name(tmp_path: Path) -> None:
    """A Mixtral-style llama GGUF (llama.expert_count) is not run as a dense model nor with guessed routing."""
    import gguf

    from edgeserve.errors import UnsupportedModelError

    w = gguf.GGUFWriter(str(tmp_path / "mixtral.gguf"), arch="llama")
    for key, value in (("block_count", 1), ("embedding_length", 64), ("feed_forward_length", 128),
                       ("attention.head_count", 4), ("expert_count", 8), ("expert_used_count", 2)):
        w.add_uint32(f"llama.{key}", value)
    w.add_vocab_size(32)
    w.add_tensor("token_embd.weight", np.zeros((32, 64), dtype=np.float32))
    finish(w)
    g = GGUFFile(tmp_path / "mixtral.gguf")
    with pytest.raises(UnsupportedModelError, match="'llama' models with experts"):
        config_from_gguf(g.metadata, set(g.tensor_names()))
    with pytest.raises(UnsupportedModelError, match="'qwen3' models with experts"):
        config_from_hf({**model_dict(), "model_type": "qwen3"})


def model_dict() -> dict:
    return hf_moe().config.to_dict()


@pytest.mark.parametrize("source", ["safetensors", "safetensors-fused", "gguf"])
def test_logits_match_transformers(source: str, tmp_path: Path) -> None:
    ref_model = hf_moe()
    ids = PROMPT + list(range(40, 40 + DECODES))
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].float()
    model = load_ours(source, ref_model, tmp_path)
    assert all(isinstance(layer.moe.gate_up, DenseExperts) for layer in model.layers)  # float32: exact path
    for got in (contiguous_logits(model), paged_logits(model)):
        assert got.shape == ref.shape
        diff = (got - ref).abs().max().item()
        assert diff < 1e-4 * max(1.0, ref.abs().max().item()), f"{source}: max diff {diff}"


native = pytest.mark.skipif(not cpu_native.available(), reason="native CPU kernels not built")


@native
@pytest.mark.parametrize("expert_qtype", ["Q8_0", "Q4_0"])
def test_block_experts_run_natively_from_the_mmap(expert_qtype: str, tmp_path: Path, monkeypatch) -> None:
    """A GGUF with block-format experts loaded in bfloat16 on CPU keeps every expert tensor as a view of the file
    (no copy; or, repacked, in the kernels' faster layout), runs in the fused native stack, and its logits stay
    close to the float32 (dequantized) load's."""
    monkeypatch.setenv("EDGESERVE_MOE_REPACK", "0")
    ref_model = hf_moe()
    native_model = load_ours("gguf", ref_model, tmp_path, torch.bfloat16, expert_qtype=expert_qtype,
                             matrix_qtype="Q8_0")
    g = GGUFFile(tmp_path / "m.gguf")
    config = config_from_gguf(g.metadata, set(g.tensor_names()))
    exact = MoEModel.from_weights(config, GGUFWeights(g, config.num_heads, config.num_kv_heads), dtype=torch.float32)
    for layer in native_model.layers:
        for experts in (layer.moe.gate_up, layer.moe.down):
            assert isinstance(experts, BlockExperts)
            assert all(not p.data.flags.owndata and not p.data.flags.writeable for p in experts.parts)  # the mmap
    assert isinstance(NativeDecoder.build(native_model), NativeDecoder)
    want = paged_logits(exact).float()
    got = paged_logits(native_model).float()
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.99
    monkeypatch.setenv("EDGESERVE_MOE_REPACK", "1")
    repacked = MoEModel.from_weights(config, GGUFWeights(g, config.num_heads, config.num_kv_heads),
                                     dtype=torch.bfloat16)
    parts = repacked.layers[0].moe.gate_up.parts
    assert [p.qtype for p in parts] == [expert_qtype + "_X8"] * 2 and isinstance(parts[0].data, torch.Tensor)
    got = paged_logits(repacked).float()
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.99


@native
@pytest.mark.parametrize("repack", ["0", "1"])
def test_engine_outputs_do_not_depend_on_batching_or_chunking(tmp_path: Path, monkeypatch, repack: str) -> None:
    from edgeserve.llm import LLM

    monkeypatch.setenv("EDGESERVE_MOE_REPACK", repack)
    path = write_moe_gguf(hf_moe(), tmp_path / "q.gguf", expert_qtype="Q4_0", matrix_qtype="Q8_0")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (5, 23, 40, 71)]
    llm = LLM(str(path), dtype="bfloat16", device="cpu", kv_cache_gb=0.01, enable_prefix_caching=False)
    experts = llm.lm.model.layers[0].moe.gate_up
    assert isinstance(experts, BlockExperts) and experts.parts[0].qtype.endswith("_X8") == (repack == "1")
    assert_batch_and_chunk_invariant(llm, prompts)


def test_dummy_load_builds_the_moe_shape(tmp_path: Path) -> None:
    """--load-format dummy of a Qwen3 MoE config.json: random experts of its shape, a finite forward pass."""
    from edgeserve.models.dummy import weight_bytes
    from edgeserve.models.load import load_model
    from edgeserve.registry.resolve import ModelSource

    cfg = hf_moe().config.to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    lm = load_model(ModelSource("tiny-moe", "hf", tmp_path / "config.json"), dtype="float32", load_format="dummy")
    assert isinstance(lm.model, MoEModel)
    assert lm.model.layers[0].moe.gate_up.shape == (EXPERTS, 2 * EXPERT_FFN, HIDDEN)
    logits = paged_logits(lm.model)
    assert torch.isfinite(logits).all()
    dense = config_from_hf({**cfg, "model_type": "qwen3", "num_experts": 0, "num_local_experts": 0})
    assert weight_bytes(lm.config, torch.float32) - weight_bytes(dense, torch.float32) == 2 * (
        EXPERTS * (3 * EXPERT_FFN * HIDDEN * 4 + HIDDEN * 4) - 3 * 128 * HIDDEN * 4)


def test_cuda_graphs_are_not_captured_for_moe(monkeypatch) -> None:
    """MoE layers group rows by expert on the host, which a captured decode graph cannot replay."""
    from edgeserve.engine.runner import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "use_triton", lambda device: True)
    moe = config_from_hf(hf_moe().config.to_dict())
    dense = config_from_hf({**hf_moe().config.to_dict(), "model_type": "qwen3", "num_experts": 0,
                            "num_local_experts": 0})
    cuda = torch.device("cuda")
    assert cuda_graphs.graphs_supported(cuda, dense) and not cuda_graphs.graphs_supported(cuda, moe)


def test_calibrated_quantization_refuses_moe_by_name() -> None:
    from edgeserve.errors import EdgeserveError
    from edgeserve.models.calibrate import awq_scales

    with pytest.raises(EdgeserveError, match="Mixture-of-Experts"):
        awq_scales(config_from_hf(hf_moe().config.to_dict()), None, [1, 2, 3], 32, torch.float32, torch.device("cpu"))


def test_gpu_path_through_triton_kernels_matches_transformers(tmp_path: Path) -> None:
    """The GPU's path on CPU tensors (Triton's interpreter): dense experts grouped in fixed tiles, the router in
    fixed tiles, Triton's norms, SiLU-and-mul, RoPE and paged attention; the logits still match transformers."""
    from kernel_utils import kernel_device

    from edgeserve.kernels import dispatch

    kernel_device("cpu")
    ref_model = hf_moe()
    ids = PROMPT + list(range(40, 40 + DECODES))
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].float()
    with dispatch.force_backend("triton"):
        model = load_ours("gguf", ref_model, tmp_path, dtype=torch.float32, expert_qtype="Q8_0")
        assert all(isinstance(layer.moe.gate_up, DenseExperts) for layer in model.layers)
        got = paged_logits(model)
    g = GGUFFile(tmp_path / "m.gguf")
    config = config_from_gguf(g.metadata, set(g.tensor_names()))
    twins = MoEModel.from_weights(config, GGUFWeights(g, config.num_heads, config.num_kv_heads), dtype=torch.float32)
    with dispatch.force_backend("torch"):
        want = paged_logits(twins)
    assert ref.abs().max() > 0.5
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)  # the same Q8_0 file through the torch twins
    assert torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0) > 0.99


@native
def test_repacked_experts_let_go_of_the_file_pages(tmp_path: Path) -> None:
    """Repacking a GGUF's experts copies them; the file's pages under the copied tensor are then unmapped from the
    process (madvise DONTNEED: resident memory drops by about the tensor's size) and still read the same bytes."""
    import psutil

    from edgeserve.kernels.formats.experts import ExpertBlocks, repacked_experts
    from edgeserve.loaders.gguf_file import release_pages

    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(8, 256, 64 // 32 * 34), dtype=np.uint8)  # 8 experts of 256 x 64 in Q8_0
    path = tmp_path / "x.bin"
    big = np.resize(data, (448, 256, data.shape[2]))  # 448 experts, about 7.8 MB
    path.write_bytes(bytes(4096) + big.tobytes())
    import mmap

    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(buf, np.uint8, big.size, 4096).reshape(big.shape)
    mapped = lambda: psutil.Process().memory_full_info().rss  # noqa: E731
    before = view.sum()  # every page mapped in
    rss_mapped = mapped()
    out = repacked_experts(ExpertBlocks("Q8_0", view, 64), cpu_native.library())
    assert out.qtype == "Q8_0_X8" and isinstance(out.data, torch.Tensor)
    assert mapped() < rss_mapped + 0.5 * big.nbytes  # the copy (about big.nbytes) minus the released pages
    assert view.sum() == before  # mapped back in on demand, same bytes
    assert not release_pages(np.array(view[0]))  # a copy is not a view of a mapping
