"""Each layer's cache as the engine reads it (engine/cache/cache_spec.py): the pools are sized from these specs."""

from __future__ import annotations

import pytest
import torch

from edgeserve.engine.cache.cache_spec import kv_owners, kv_source, layer_caches, state_layers
from edgeserve.engine.cache.kv_cache import KVPool, kv_bytes_per_token
from edgeserve.engine.cache.state_pool import state_spec_for
from edgeserve.models.config import ModelConfig

BASE = dict(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_heads=4,
            num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=256,
            tie_word_embeddings=True)


def test_sliding_global_and_shared_layers():
    """Gemma 4-like: sliding layers of one head shape, global ones of another, the last two reading earlier K/V."""
    c = ModelConfig(**BASE, num_layers=6, layer_windows=(16, 16, None, 16, 16, None), kv_shared_layers=2,
                    global_head_dim=16, global_kv_heads=1)
    caches = layer_caches(c)
    assert [x.kind for x in caches] == ["window", "window", "full", "window", "shared", "shared"]
    assert (caches[0].kv_heads, caches[0].head_dim, caches[0].window) == (2, 8, 16)
    assert (caches[2].kv_heads, caches[2].head_dim, caches[2].window) == (1, 16, None)
    assert [kv_source(caches, i) for i in range(6)] == [0, 1, 2, 3, 3, 2]
    assert kv_owners(c) == [0, 1, 2, 3]
    # the pool holds the owners only: 3 sliding layers of 2x8 and one global of 1x16, K and V, f32
    assert kv_bytes_per_token(c, torch.float32) == 2 * 4 * (3 * 2 * 8 + 16)
    pool = KVPool(c, num_blocks=4, block_size=16, dtype=torch.float32)
    assert pool.layer_slot[4] == pool.layer_slot[3] and pool.layer_slot[5] == pool.layer_slot[2]


def test_state_and_mixerless_layers_keep_no_kv():
    """A hybrid: state layers keep their declared state, MLP-only blocks nothing; only attention owns K/V."""
    from edgeserve.engine.cache.state_pool import short_conv_kind

    kind = short_conv_kind(3, 32)
    c = ModelConfig(**BASE, num_layers=4, linear_layers=(True, False, True, False), state_kind=kind,
                    mixerless_layers=(False, False, False, True))
    caches = layer_caches(c)
    assert [x.kind for x in caches] == ["none", "full", "none", "none"]
    assert [x.state for x in caches] == [kind, None, kind, None]
    assert kv_owners(c) == [1]
    assert state_layers(c) == (2, kind)
    spec = state_spec_for(c)
    assert spec.num_layers == 2 and spec.kind == kind


def test_a_layer_may_keep_kv_and_a_state():
    """Falcon-H1: attention beside a Mamba-2 state in every layer."""
    from edgeserve.engine.cache.state_pool import mamba2_kind

    kind = mamba2_kind(4, 64, 2, 16, 8)
    c = ModelConfig(**BASE, num_layers=2, linear_layers=(True, True), state_kind=kind, attention_beside_state=True)
    caches = layer_caches(c)
    assert [(x.kind, x.state) for x in caches] == [("full", kind), ("full", kind)]
    assert kv_owners(c) == [0, 1] and state_layers(c) == (2, kind)


def test_a_model_without_states_has_no_state_spec():
    c = ModelConfig(**BASE, num_layers=2)
    assert state_layers(c) == (0, None) and [x.kind for x in layer_caches(c)] == ["full", "full"]
    with pytest.raises(ValueError, match="no state layers"):
        state_spec_for(c)
