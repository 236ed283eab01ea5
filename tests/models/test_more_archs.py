"""gemma2, gemma3 and phi3 on tiny random models written here, as HF safetensors folders and as GGUF files:
our logits against transformers' through prefill and decode (contiguous cache and paged cache)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention
from edgeserve.kernels.dispatch import AttentionMetadata
from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.loaders.gguf_weights import GGUFWeights
from edgeserve.models.config import config_from_gguf, config_from_hf
from edgeserve.models.decoders import decoder_class

from support import logit_runs
from support.gguf_writer import write_model_gguf
from support.model_sources import gguf_source, saved_source

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 96, 64, 4, 2, 16, 128
PROMPT = [1, 5, 17, 33, 2, 60, 7, 81]  # 8 prompt tokens, then decodes
DECODES = 4
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_attention_heads=HEADS,
              num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=64, rms_norm_eps=1e-6,
              tie_word_embeddings=False)


def hf_model(arch: str):
    torch.manual_seed(0)
    if arch == "gemma2":
        cfg = transformers.Gemma2Config(num_hidden_layers=3, sliding_window=5, query_pre_attn_scalar=HEAD_DIM,
                                        attn_logit_softcapping=0.5, final_logit_softcapping=2.0, **COMMON)
        cls = transformers.Gemma2ForCausalLM
    elif arch == "gemma3":
        cfg = transformers.Gemma3TextConfig(num_hidden_layers=7, sliding_window=5, query_pre_attn_scalar=HEAD_DIM,
                                            **COMMON)
        cls = transformers.Gemma3ForCausalLM
    else:
        cfg = transformers.Phi3Config(num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                      **{k: v for k, v in COMMON.items() if k != "head_dim"})
        cls = transformers.Phi3ForCausalLM
    cfg._attn_implementation = "eager"
    model = cls(cfg).eval()
    with torch.no_grad():  # bigger than the default init, so attention is far from uniform and soft-caps bite
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5 if "norm" in name else 0.15)
    return model


def write_gguf(model, arch: str, path: Path, q8_0: bool = False) -> Path:
    """The model as llama.cpp's converter writes an `arch` GGUF; `q8_0` stores every matrix as Q8_0 blocks (else
    float32)."""
    return write_model_gguf(model, path, arch, qtype="Q8_0" if q8_0 else "F32")


def ours(arch: str, model, tmp_path: Path, source: str):
    if source == "safetensors":
        config, weights = saved_source(model, tmp_path / "hf")
    else:
        config, weights = gguf_source(write_gguf(model, arch, tmp_path / "m.gguf"))
    assert config.architecture == arch
    return decoder_class(config).from_weights(config, weights, dtype=torch.float32)


def contiguous_logits(model) -> torch.Tensor:
    """Prefill PROMPT, then decode DECODES tokens one at a time."""
    return logit_runs.contiguous_logits(model, PROMPT, DECODES)


def paged_logits(model, block_size: int = 4) -> torch.Tensor:
    """The same through a float32 paged pool: the prompt in two chunks, then single-token decode steps."""
    return logit_runs.paged_logits(model, PROMPT, DECODES, block_size, kv_dtype=torch.float32)


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3"])
def test_logits_match_transformers(arch: str, source: str, tmp_path: Path) -> None:
    ref_model = hf_model(arch)
    ids = PROMPT + list(range(40, 40 + DECODES))
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].float()
    model = ours(arch, ref_model, tmp_path, source)
    if arch.startswith("gemma"):
        assert any(w is not None for w in model.config.layer_windows) and len(ids) > 5  # the window is exercised
    for got in (contiguous_logits(model), paged_logits(model)):
        assert got.shape == ref.shape
        diff = (got - ref).abs().max().item()
        assert diff < 1e-4 * max(1.0, ref.abs().max().item()), f"{arch}/{source}: max diff {diff}"


def test_other_architectures_are_refused_by_name() -> None:
    from edgeserve.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="'falcon'.*gemma3.*phi3"):
        config_from_hf({"model_type": "falcon", "hidden_size": 8})
    with pytest.raises(UnsupportedModelError, match="partial rotary"):  # phi3 has it (test_phi3_partial_rope)
        config_from_hf({"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
                        "num_hidden_layers": 1, "num_attention_heads": 2, "partial_rotary_factor": 0.75})


@pytest.mark.parametrize("arch", ["gemma3", "phi3"])
def test_block_weights_run_natively_at_the_cpu_serving_dtype(arch: str, tmp_path: Path) -> None:
    """A Q8_0 GGUF of each architecture loaded in bfloat16 on CPU: every projection (Phi-3's parts of its fused
    qkv and gate_up included) is a native BlockWeight, and the logits stay close to the float32 load's."""
    from edgeserve.kernels.cpu import native as cpu_native
    from edgeserve.kernels.cpu.native import BlockWeight

    if cpu_native.library() is None:
        pytest.skip("native CPU kernels not built here")
    g = GGUFFile(write_gguf(hf_model(arch), arch, tmp_path / "q8.gguf", q8_0=True))
    config = config_from_gguf(g.metadata, set(g.tensor_names()))

    def load(dtype):
        weights = GGUFWeights(g, config.num_heads, config.num_kv_heads)
        return decoder_class(config).from_weights(config, weights, dtype=dtype)

    native, ref = load(torch.bfloat16), load(torch.float32)
    for layer in native.layers:
        assert all(isinstance(w, BlockWeight) for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
    ids = PROMPT + list(range(40, 40 + DECODES))
    c = config

    def logits(model) -> torch.Tensor:
        pool = KVPool(c, 8, 4, model.dtype)
        meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(8))], list(range(len(ids))))
        return model.logits(model.forward(torch.tensor(ids), torch.arange(len(ids)), PagedKVAttention(pool, meta)))

    got, want = logits(native).float(), logits(ref).float()
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.99
