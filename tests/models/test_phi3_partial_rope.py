"""Phi-4-mini's partial RoPE (`partial_rotary_factor` 0.75: only the first 3/4 of each head's dims rotate) on tiny
random Phi-3 models, with and without longrope, as HF safetensors folders and as GGUF files (llama.cpp's
`rope.dimension_count` below the head size): our logits against transformers' in float32 through prefill and decode,
on a contiguous and a paged cache, and natively from Q8_0 blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from test_more_archs import COMMON, DECODES, PROMPT, contiguous_logits, ours, write_gguf

transformers = pytest.importorskip("transformers")

HEAD = COMMON["hidden_size"] // COMMON["num_attention_heads"]  # 16: 12 rotated dims, 4 passed through
SHORT = [1.0 + 0.1 * i for i in range(HEAD * 3 // 8)]  # one longrope factor per rotated pair


def phi3(longrope: bool, factor: float = 0.75):
    torch.manual_seed(0)
    common = {k: v for k, v in COMMON.items() if k != "head_dim"}
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if longrope:
        common.update(max_position_embeddings=64, original_max_position_embeddings=32)
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT,
                "long_factor": [2.0] * len(SHORT)}
    cfg = transformers.Phi3Config(num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                  partial_rotary_factor=factor,
                                  rope_parameters={**rope, "partial_rotary_factor": factor},
                                  **common)
    cfg._attn_implementation = "eager"
    model = transformers.Phi3ForCausalLM(cfg).eval()
    assert model.model.rotary_emb.inv_freq.shape == (int(HEAD * factor) // 2,)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5 if "norm" in name else 0.15)
    return model


def paged_logits(model, block_size: int = 4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Prefill PROMPT in two chunks through a paged pool of `dtype`, then decode DECODES tokens one at a time."""
    from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention
    from edgeserve.kernels.dispatch import AttentionMetadata

    ids = PROMPT + list(range(40, 40 + DECODES))
    pool = KVPool(model.config, 8, block_size, dtype)
    out = []
    for a, b in [(0, 5), (5, len(PROMPT))] + [(p, p + 1) for p in range(len(PROMPT), len(ids))]:
        meta = AttentionMetadata.build([b - a], [b], [list(range(8))], list(range(a, b)))
        hidden = model.forward(torch.tensor(ids[a:b]), torch.arange(a, b), PagedKVAttention(pool, meta))
        out.append(model.logits(hidden))
    return torch.cat(out)


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([PROMPT + list(range(40, 40 + DECODES))])).logits[0].float()


def load(model, source: str, tmp_path: Path, longrope: bool, factor: float = 0.75):
    if source == "safetensors":
        return ours("phi3", model, tmp_path, source)
    from edgeserve.loaders.gguf_file import GGUFFile
    from edgeserve.loaders.gguf_weights import GGUFWeights
    from edgeserve.models.config import config_from_gguf
    from edgeserve.models.decoders import decoder_class

    g = GGUFFile(write_gguf(model, "phi3", tmp_path / "p.gguf"))
    config = config_from_gguf(g.metadata, set(g.tensor_names()))
    return decoder_class(config).from_weights(config, GGUFWeights(g, config.num_heads, config.num_kv_heads),
                                              dtype=torch.float32)


@pytest.mark.parametrize("longrope", [False, True])
@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_partial_rope_logits_match_transformers(source: str, longrope: bool, tmp_path: Path) -> None:
    model = phi3(longrope)
    ref = reference(model)
    ours_ = load(model, source, tmp_path, longrope)
    assert ours_.config.rotary_dim == 12
    for got in (contiguous_logits(ours_), paged_logits(ours_)):
        diff = (got - ref).abs().max().item()
        assert diff < 1e-4 * max(1.0, ref.abs().max().item()), f"{source}, longrope {longrope}: max diff {diff}"


def test_the_unrotated_dims_matter(tmp_path: Path) -> None:
    """Loaded as if every dim rotated, the same weights give other logits: the test above sees partial RoPE."""
    import dataclasses

    from edgeserve.loaders.hf_folder import HFFolder
    from edgeserve.models.archs.phi3.model import Phi3Model

    model = phi3(False)
    ref = reference(model)
    ours_ = ours("phi3", model, tmp_path, "safetensors")
    config = dataclasses.replace(ours_.config, rotary_dim=None)
    full = Phi3Model.from_weights(config, HFFolder(tmp_path / "hf").weights(), dtype=torch.float32)
    assert (contiguous_logits(full) - ref).abs().max().item() > 1e-2


def test_q8_0_blocks_run_natively_with_partial_rope(tmp_path: Path) -> None:
    """A Q8_0 GGUF in bfloat16 on CPU: the permuted q / k rows are native block weights and the logits stay near
    the float32 load's."""
    from edgeserve.kernels.cpu import native as cpu_native
    from edgeserve.kernels.cpu.native import BlockWeight
    from edgeserve.loaders.gguf_file import GGUFFile
    from edgeserve.loaders.gguf_weights import GGUFWeights
    from edgeserve.models.config import config_from_gguf
    from edgeserve.models.decoders import decoder_class

    if cpu_native.library() is None:
        pytest.skip("native CPU kernels not built here")
    g = GGUFFile(write_gguf(phi3(True), "phi3", tmp_path / "q8.gguf", q8_0=True))
    config = config_from_gguf(g.metadata, set(g.tensor_names()))

    def run(dtype):
        m = decoder_class(config).from_weights(config, GGUFWeights(g, config.num_heads, config.num_kv_heads),
                                               dtype=dtype)
        return m, paged_logits(m, dtype=dtype).float()

    (native, got), (_, want) = run(torch.bfloat16), run(torch.float32)
    assert all(isinstance(layer.qkv, BlockWeight) for layer in native.layers)
    assert native.native_decoder() is not None  # decode steps ran the fused native stack
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.99
