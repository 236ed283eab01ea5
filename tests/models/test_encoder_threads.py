"""The encoder's thread choice: one torch intra-op thread beside the native pool or for a small batch, set on the
calling thread only, with the same results as torch's full thread count."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from edgeserve.kernels.cpu.native import library
from edgeserve.models.encoders import bert
from edgeserve.models.encoders.bert import pad_batch, pool
from edgeserve.models.encoder_threads import SMALL_BATCH_TOKENS, _omp_runtime, encoder_threads, intra_op_threads
from encoder_gguf import write_encoder_gguf
from test_encoder_native import TEXTS, VOCAB, _bert_state, _load

needs_omp = pytest.mark.skipif(_omp_runtime() is None, reason="torch has no OpenMP runtime here")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@needs_omp
def test_intra_op_threads_is_per_thread_and_restored(two_threads):
    seen: dict[str, int] = {}
    inside, release = threading.Event(), threading.Event()

    def encoder_side():
        with intra_op_threads(1):
            seen["inside"] = torch.get_num_threads()
            inside.set()
            release.wait(30)
        seen["after"] = torch.get_num_threads()

    t = threading.Thread(target=encoder_side)
    t.start()
    assert inside.wait(30)
    seen["other thread meanwhile"] = torch.get_num_threads()
    late = threading.Thread(target=lambda: seen.__setitem__("thread started meanwhile", torch.get_num_threads()))
    late.start()
    late.join()
    release.set()
    t.join()
    assert seen == {"inside": 1, "other thread meanwhile": 2, "thread started meanwhile": 2, "after": 2}


def test_intra_op_threads_none_leaves_the_count(two_threads):
    with intra_op_threads(None):
        assert torch.get_num_threads() == 2


@pytest.mark.skipif(library() is None, reason="native CPU kernels unavailable")
def test_native_encoder_runs_one_torch_thread_with_the_same_results(tmp_path, monkeypatch, two_threads):
    path = write_encoder_gguf(tmp_path / "q8.gguf", "bert", _bert_state(64, 2, 128), VOCAB, hidden=64, layers=2,
                              heads=4, ffn=128, context=128, pooling_type=1, qtype="Q8_0")
    lm = _load(path, monkeypatch, True)
    assert lm.on_native_pool and encoder_threads(lm.on_native_pool, 10**6) == 1
    counts = _counting(lm, monkeypatch)
    pooled: list[int] = []  # pooling too: beside the native pool's spinning workers it is slow on two threads
    monkeypatch.setattr(bert, "pool", lambda *a: pooled.append(torch.get_num_threads()) or pool(*a))
    seqs = [lm.encode(t)[0] for t in TEXTS] * 8  # past SMALL_BATCH_TOKENS: one thread for the native pool's sake
    assert len(seqs) * max(map(len, seqs)) >= SMALL_BATCH_TOKENS
    got = lm.embed(seqs)
    assert counts == pooled == ([1] if _omp_runtime() is not None else [2])
    ids, mask = pad_batch(seqs)
    want = pool(type(lm.model).forward(lm.model, ids, mask), mask, lm.config.pooling, lm.config.normalize)
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5)


def _counting(lm, monkeypatch) -> list[int]:
    counts: list[int] = []
    forward = lm.model.forward
    monkeypatch.setattr(lm.model, "forward", lambda *a: counts.append(torch.get_num_threads()) or forward(*a))
    return counts


@needs_omp
def test_dense_encoder_uses_one_thread_for_small_batches_only(tmp_path, monkeypatch, two_threads):
    path = write_encoder_gguf(tmp_path / "f32.gguf", "bert", _bert_state(64, 1, 128), VOCAB, hidden=64, layers=1,
                              heads=4, ffn=128, context=128, pooling_type=1, qtype="F32")
    lm = _load(path, monkeypatch, True)
    assert not lm.on_native_pool
    counts = _counting(lm, monkeypatch)
    small = [lm.encode("the cat sat")[0]]
    large = [lm.encode("the cat sat on the mat . " * 12)[0]] * (SMALL_BATCH_TOKENS // 40 + 1)
    assert len(small[0]) < SMALL_BATCH_TOKENS <= len(large) * max(map(len, large))
    one = lm.embed(small)
    lm.embed(large)
    assert counts == [1, 2]
    ids, mask = pad_batch(small)
    want = pool(type(lm.model).forward(lm.model, ids, mask), mask, lm.config.pooling, lm.config.normalize)
    np.testing.assert_allclose(one.numpy(), want.numpy(), atol=1e-5)
