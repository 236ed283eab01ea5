"""The recurrent-state slot pool (edgeserve.engine.cache.state_pool): slots are handed out zeroed and taken back once,
the pool runs out cleanly, a copy is an independent snapshot, a layer's views are the pool's own memory, the byte
counts are the tensors' and the integrity check catches broken bookkeeping."""

from __future__ import annotations

import random

import pytest
import torch

from edgeserve.engine.cache.state_pool import (LayerStateKind, OutOfSlotsError, StatePool, StateSpec, StateTensor,
                                        gated_delta_kind, mamba2_kind, short_conv_kind, slots_for_budget)
from edgeserve.kernels.torch.gated_delta import DeltaNetDims

DIMS = DeltaNetDims(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6, conv_kernel=4)


def pool(num_slots: int = 3, layers: int = 2) -> StatePool:
    return StatePool(StateSpec(layers, DIMS), num_slots)


def test_shapes_and_bytes():
    p = pool(3, 2)
    assert p.conv.shape == (3, 2, 3, DIMS.conv_dim)
    assert p.recurrent.shape == (3, 2, 4, 8, 6)
    per_seq = p.spec.bytes_per_sequence
    assert per_seq * 3 == p.conv.nbytes + p.recurrent.nbytes == p.nbytes
    assert per_seq == 2 * 4 * (3 * DIMS.conv_dim + 4 * 8 * 6)
    assert slots_for_budget(per_seq * 5 + per_seq - 1, p.spec) == 5


def test_allocate_until_empty_then_refuse_and_reuse():
    p = pool(3)
    got = [p.allocate() for _ in range(3)]
    assert sorted(got) == [0, 1, 2]
    assert not p.can_allocate() and p.num_free == 0 and p.num_used == 3
    with pytest.raises(OutOfSlotsError):
        p.allocate()
    p.free(got[1])
    assert p.can_allocate(1) and not p.can_allocate(2)
    assert p.allocate() == got[1]
    p.check()


def test_allocated_slot_is_zeroed_and_others_untouched():
    p = pool(3)
    a, b = p.allocate(), p.allocate()
    p.conv[a].fill_(1.0)
    p.recurrent[a].fill_(2.0)
    p.recurrent[b].fill_(3.0)
    p.free(a)
    again = p.allocate()
    assert again == a
    assert not p.conv[again].any() and not p.recurrent[again].any()
    assert (p.recurrent[b] == 3.0).all()


def test_free_errors():
    p = pool(2)
    s = p.allocate()
    p.free(s)
    with pytest.raises(ValueError, match="not in use"):
        p.free(s)
    with pytest.raises(ValueError, match="not in use"):
        p.free(7)
    p.check()


def test_copy_is_a_snapshot():
    p = pool(3)
    src, dst = p.allocate(), p.allocate()
    p.conv[src].normal_()
    p.recurrent[src].normal_()
    p.copy(src, dst)
    assert torch.equal(p.conv[dst], p.conv[src]) and torch.equal(p.recurrent[dst], p.recurrent[src])
    kept = p.recurrent[dst].clone()
    p.recurrent[src].add_(1.0)  # the source moves on; the snapshot does not
    assert torch.equal(p.recurrent[dst], kept)
    p.copy(dst, src)  # rollback
    assert torch.equal(p.recurrent[src], kept)
    with pytest.raises(ValueError, match="not in use"):
        p.copy(src, 2)


def test_layer_views_write_through_to_one_layer():
    p = pool(3, layers=3)
    conv, rec = p.layer(1)
    assert conv.shape == (3, 3, DIMS.conv_dim) and rec.shape == (3, 4, 8, 6)
    assert conv.data_ptr() == p.conv[0, 1].data_ptr() and conv[0].is_contiguous()
    rec[torch.tensor([2])] = 5.0  # the kernels write with an index like this
    conv[2] = 4.0
    assert (p.recurrent[2, 1] == 5.0).all() and (p.conv[2, 1] == 4.0).all()
    assert not p.recurrent[:, [0, 2]].any() and not p.recurrent[:2].any() and not p.conv[:, [0, 2]].any()
    with pytest.raises(IndexError):
        p.layer(3)


def test_random_traffic_keeps_the_books():
    p = pool(8)
    rng = random.Random(0)
    held: list[int] = []
    for _ in range(500):
        if held and (not p.can_allocate() or rng.random() < 0.45):
            p.free(held.pop(rng.randrange(len(held))))
        else:
            held.append(p.allocate())
        assert p.num_used == len(held) == len(set(held))
    p.check()


def test_check_catches_broken_books():
    p = pool(3)
    s = p.allocate()
    p._free.append(s)  # a slot both used and free
    with pytest.raises(AssertionError, match="both free and used"):
        p.check()
    p = pool(3)
    p._free.pop()  # a lost slot
    with pytest.raises(AssertionError, match="lost"):
        p.check()


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        StatePool(StateSpec(1, DIMS), 0)
    with pytest.raises(ValueError):
        StateSpec(0, DIMS)


def test_a_spec_from_dims_is_the_gated_delta_kind():
    spec = StateSpec(2, DIMS)
    assert spec == StateSpec(2, gated_delta_kind(DIMS)) and spec.kind.name == "gated_delta"
    assert [t.name for t in spec.tensors] == ["conv", "recurrent"]
    assert spec.conv_shape == (3, DIMS.conv_dim) and spec.recurrent_shape == (4, 8, 6)
    assert spec.format == f"gated_delta/2/conv:3x{DIMS.conv_dim}:float32,recurrent:4x8x6:float32"


@pytest.mark.parametrize("kind, names", [(short_conv_kind(3, 10), ["conv"]), (mamba2_kind(4, 12, 2, 5, 7), ["conv", "ssm"])])
def test_other_kinds_get_pools_of_what_they_declare(kind, names):
    p = StatePool(StateSpec(3, kind), 4)
    assert list(p.tensors) == names
    for t in kind.tensors:
        assert getattr(p, t.name).shape == (4, 3, *t.shape)
    assert p.nbytes == sum(x.nbytes for x in p.tensors.values()) == 4 * p.spec.bytes_per_sequence
    a, b = p.allocate(), p.allocate()
    for x in p.tensors.values():
        x[a].normal_()
    p.copy(a, b)
    assert all(torch.equal(x[a], x[b]) for x in p.tensors.values())
    assert [v.shape for v in p.slot_views(b)] == [(3, *t.shape) for t in kind.tensors]
    assert len(p.layer(0)) == len(names)
    assert not hasattr(p, "recurrent") or "recurrent" in names
    assert StateSpec(3, kind).format != StateSpec(2, kind).format


def test_per_tensor_dtypes_count_in_bytes_and_format():
    kind = LayerStateKind("mixed", (StateTensor("conv", (2, 4), torch.bfloat16), StateTensor("ssm", (3,))))
    spec = StateSpec(2, kind)
    assert spec.bytes_per_sequence == 2 * (8 * 2 + 3 * 4)
    p = StatePool(spec, 2)
    assert p.conv.dtype == torch.bfloat16 and p.ssm.dtype == torch.float32
    assert "conv:2x4:bfloat16" in spec.format
    with pytest.raises(ValueError):
        LayerStateKind("dup", (StateTensor("a", (1,)), StateTensor("a", (2,))))


def test_a_hybrid_configs_spec_and_a_plain_one_refused():
    from edgeserve.engine.cache.state_pool import state_spec_for
    from edgeserve.models.config import ModelConfig

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8,
                rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=256, tie_word_embeddings=True)
    hybrid = ModelConfig("qwen35", num_layers=4, linear_layers=(True, True, True, False), delta=DIMS, **base)
    assert state_spec_for(hybrid) == StateSpec(3, DIMS)
    conv = short_conv_kind(3, 8)  # LFM2's: the config's layer_state names the kind
    lfm2 = ModelConfig("lfm2", num_layers=3, linear_layers=(True, False, True), state_kind=conv, **base)
    assert state_spec_for(lfm2) == StateSpec(2, conv) and state_spec_for(lfm2).conv_shape == (2, 8)
    with pytest.raises(ValueError, match="no state layers"):
        state_spec_for(ModelConfig("llama", num_layers=2, **base))


class Rows:
    """Owed rows that add 1 to every value of the slot per row they settle (kernels.cpu.recurrent_step.OwedDrafts'
    contract: settle the first `rows`, return the rest)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def settle(self, p: StatePool, slot: int, rows: int | None = None):
        rows = self.n if rows is None else rows
        for t in p.tensors.values():
            t[slot] += rows
        return Rows(self.n - rows) if rows < self.n else None


def test_owed_rows_are_settled_before_any_read_and_dropped_with_the_slot():
    """Rows owed to a slot (a verification's accepted drafts) reach its states before a copy reads it, before the
    offload tiers' views and the per-op layer views; a step takes them (no longer owed); a copy over a slot or
    freeing it drops what it owed; a snapshot can stand before the last rows (settle with `leave`)."""
    p = pool(4)
    a, b, c = p.allocate(), p.allocate(), p.allocate()
    p.owe(a, Rows(2))
    p.copy(a, b)
    assert (p.conv[b] == 2).all() and (p.conv[a] == 2).all() and not p.owed
    p.owe(a, Rows(3))
    assert not p.settle(a, leave=4)  # fewer rows owed than asked to leave: nothing changes
    assert (p.conv[a] == 2).all() and p.owed[a].n == 3
    assert p.settle(a, leave=1)  # two of three now, one still owed
    assert (p.conv[a] == 4).all() and p.owed[a].n == 1
    p.copy(a, c, settle=False)  # a snapshot of the states as they stand
    assert (p.conv[c] == 4).all() and p.owed[a].n == 1
    p.slot_views(a)
    assert (p.recurrent[a] == 5).all() and not p.owed
    p.owe(b, Rows(1))
    p.layer(0)
    assert (p.conv[b] == 3).all() and not p.owed
    p.owe(a, Rows(1)), p.owe(b, Rows(2))
    taken = p.take_owed([b, c])
    assert taken[0].n == 2 and taken[1] is None and set(p.owed) == {a}
    p.owe(c, Rows(1))
    p.copy(b, c)  # c's owed rows are overwritten with its states
    p.free(a)
    assert not p.owed and (p.conv[c] == p.conv[b]).all()
    p.check()
    p.owe(b, Rows(1))
    p.owe(b, Rows(1))  # owing more settles what was owed first
    assert (p.conv[b] == 4).all() and p.owed[b].n == 1
    with pytest.raises(ValueError):
        p.owe(a, Rows(1))  # a free slot owes nothing
