"""GGUF encoders whose layer matrices are quantized run those matmuls on the native CPU kernels (BlockWeight), and
give the embeddings / scores of the dequantized float path within tolerance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgeserve.kernels.formats.bf16_weight import Bf16Weight, bf16_library
from edgeserve.kernels.cpu.native import BlockWeight, library
from edgeserve.registry import resolve
from encoder_gguf import write_encoder_gguf

pytestmark = pytest.mark.skipif(library() is None, reason="native CPU kernels unavailable")

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [c for c in "abcdefghijklmnopqrstuvwxyz"] + [
    "the", "cat", "sat", "on", "mat", "river", "mountain", "blue", "##s", "##ed", "##ing", "."]
TEXTS = ["the cat sat on the mat .", "blue river", "mountains", "the " * 40, "a"]


def _bert_state(hidden: int, layers: int, ffn: int, seed: int = 0) -> dict[str, torch.Tensor]:
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=len(VOCAB), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                     intermediate_size=ffn, max_position_embeddings=128, type_vocab_size=2)
    return BertModel(cfg, add_pooling_layer=False).eval().state_dict()


def _load(path, monkeypatch, native: bool):
    from edgeserve.models.encoders.gguf_encoder import load_gguf_encoder

    monkeypatch.setenv("EDGESERVE_NATIVE", "1" if native else "0")
    return load_gguf_encoder(resolve(str(path)), dtype="float32")


def _state(arch: str) -> dict[str, torch.Tensor]:
    from encoder_references import jina_state, nomic_state

    if arch == "nomic-bert":
        return nomic_state(64, 2, 128, len(VOCAB))
    if arch == "jina-bert-v2":  # the fused GLU up: split after dequantizing
        return jina_state(64, 2, 128, len(VOCAB), fused=True, qk_norm=False)
    return _bert_state(hidden=64, layers=2, ffn=128)


@pytest.mark.parametrize("arch", ["bert", "nomic-bert", "jina-bert-v2"])
def test_q8_encoder_native_equals_float_path(tmp_path, monkeypatch, arch):
    sd = _state(arch)
    path = write_encoder_gguf(tmp_path / f"{arch}.gguf", arch, sd, VOCAB, hidden=64, layers=2, heads=4, ffn=128,
                              context=128, pooling_type=1, qtype="Q8_0")
    native, dense = _load(path, monkeypatch, True), _load(path, monkeypatch, False)
    q = "encoder.layer.0.attention.output.dense.weight"
    assert isinstance(native.model.w[q], BlockWeight) and isinstance(dense.model.w[q], torch.Tensor)
    assert isinstance(native.model.w["embeddings.word_embeddings.weight"], torch.Tensor)  # lookups stay dense
    seqs = [native.encode(t)[0] for t in TEXTS]
    got, want = native.embed(seqs).numpy(), dense.embed(seqs).numpy()
    cos = (got * want).sum(-1)  # both L2-normalized
    assert cos.min() > 0.999
    np.testing.assert_allclose(got, want, atol=2e-2)


def test_f16_encoder_stays_dense(tmp_path, monkeypatch):
    path = write_encoder_gguf(tmp_path / "f16.gguf", "bert", _bert_state(64, 1, 128), VOCAB, hidden=64, layers=1,
                              heads=4, ffn=128, context=128, pooling_type=1, qtype="F16")
    lm = _load(path, monkeypatch, True)
    assert all(isinstance(v, torch.Tensor) for v in lm.model.w.values())


def _load_auto(path, monkeypatch, flags):
    from edgeserve.models.encoders import gguf_encoder

    monkeypatch.setattr(gguf_encoder, "cpu_flags", lambda: frozenset(flags))
    return gguf_encoder.load_gguf_encoder(resolve(str(path)), dtype="auto")


def test_f16_matrices_multiply_in_bf16_where_the_cpu_has_bf16_dots(tmp_path, monkeypatch):
    path = write_encoder_gguf(tmp_path / "f16.gguf", "bert", _bert_state(64, 2, 128), VOCAB, hidden=64, layers=2,
                              heads=4, ffn=128, context=128, pooling_type=1, qtype="F16")
    q = "encoder.layer.0.attention.output.dense.weight"
    fast = _load_auto(path, monkeypatch, {"avx2", "avx512_bf16"})
    plain = _load_auto(path, monkeypatch, {"avx2"})  # an AVX2-only CPU: torch's bfloat16 GEMM is slow there
    exact = _load(path, monkeypatch, True)  # dtype float32 asked for
    if bf16_library() is not None:  # this CPU runs the native bfloat16 kernel (AVX-512 BF16)
        assert isinstance(fast.model.w[q], Bf16Weight) and fast.on_native_pool
    else:
        assert fast.model.w[q].dtype == torch.bfloat16
    assert plain.model.w[q].dtype == torch.float32 and exact.model.w[q].dtype == torch.float32
    assert fast.model.w["embeddings.LayerNorm.weight"].dtype == torch.float32  # only the layer matrices
    seqs = [fast.encode(t)[0] for t in TEXTS]
    got, want = fast.embed(seqs).numpy(), exact.embed(seqs).numpy()
    assert got.dtype == np.float32 and (got * want).sum(-1).min() > 0.9999
    np.testing.assert_array_equal(plain.embed(seqs).numpy(), want)


def test_an_embedding_load_leaves_forwards_reusing_their_buffers(tmp_path, monkeypatch):
    """Loading an encoder ends with glibc's step-buffer setting (as a text model's load does): a 512-token forward
    otherwise mapped fresh pages for its attention and GELU outputs, thousands of page faults per request."""
    from edgeserve import memory
    from edgeserve.models.encoders.embedders import load_embedding_model

    path = write_encoder_gguf(tmp_path / "q8.gguf", "bert", _bert_state(64, 1, 128), VOCAB, hidden=64, layers=1,
                              heads=4, ffn=128, context=128, pooling_type=1, qtype="Q8_0")
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(memory, "_mallopt", lambda *settings: calls.extend(settings))
    load_embedding_model(resolve(str(path)))
    assert calls[-2:] == [(memory._M_MMAP_THRESHOLD, memory.STEP_MMAP_THRESHOLD),
                          (memory._M_TRIM_THRESHOLD, memory.STEP_TRIM_THRESHOLD)]


@pytest.mark.parametrize("arch", ["nomic-bert", "jina-bert-v2"])
def test_f16_matrices_of_fused_encoders_in_bf16_match_float32(tmp_path, monkeypatch, arch):
    """nomic's fused QKV and jina's fused GLU up (split into two after loading) on the bfloat16 path too (bfloat16
    activations on these random models: cosine 0.99987 / 0.99995 natively, 0.99975 / 0.99989 on torch's path)."""
    path = write_encoder_gguf(tmp_path / f"{arch}.gguf", arch, _state(arch), VOCAB, hidden=64, layers=2, heads=4,
                              ffn=128, context=128, pooling_type=1, qtype="F16")
    fast = _load_auto(path, monkeypatch, {"avx2", "avx512_bf16"})
    exact = _load(path, monkeypatch, True)
    name = "encoder.layer.0.intermediate.gate.weight"
    if bf16_library() is not None:
        assert isinstance(fast.model.w[name], Bf16Weight)
    seqs = [fast.encode(t)[0] for t in TEXTS]
    got, want = fast.embed(seqs).numpy(), exact.embed(seqs).numpy()
    assert (got * want).sum(-1).min() > 0.9995


@pytest.mark.parametrize("qtype", ["Q8_0", "F16"])
def test_native_query_key_value_run_as_one_matmul_with_the_same_bits(tmp_path, monkeypatch, qtype):
    from edgeserve.models.encoders import bert

    sd = _bert_state(64, 2, 128)
    gen = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(v.shape, generator=gen) * 0.1 if k.endswith("self.query.bias") or k.endswith("self.key.bias")
          or k.endswith("self.value.bias") else v for k, v in sd.items()}  # (BERT's init leaves them zero)
    path = write_encoder_gguf(tmp_path / f"{qtype}.gguf", "bert", sd, VOCAB, hidden=64,
                              layers=2, heads=4, ffn=128, context=128, pooling_type=1, qtype=qtype)
    fused = _load_auto(path, monkeypatch, {"avx2", "avx512_bf16"})
    monkeypatch.setattr(bert, "fuse_qkv", lambda cfg, weights: None)
    apart = _load_auto(path, monkeypatch, {"avx2", "avx512_bf16"})
    p = "encoder.layer.1.attention.self"
    if not fused.on_native_pool:  # F16 where the CPU lacks AVX-512 BF16: torch tensors, nothing to fuse
        assert f"{p}.qkv.weight" not in fused.model.w
        return
    assert f"{p}.qkv.weight" in fused.model.w and f"{p}.query.weight" not in fused.model.w
    assert f"{p}.query.weight" in apart.model.w and f"{p}.qkv.weight" not in apart.model.w
    seqs = [fused.encode(t)[0] for t in TEXTS]
    assert torch.equal(fused.embed(seqs), apart.embed(seqs))
