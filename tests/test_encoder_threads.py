"""The encoder's thread choice: one torch intra-op thread beside the native pool, set on the calling thread only,
with the same results as torch's full thread count."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from edgeserve.kernels.cpu_native import library
from edgeserve.models.bert import pad_batch, pool
from edgeserve.models.encoder_threads import _omp_runtime, intra_op_threads
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
    assert lm.forward_threads == 1
    counts = []
    forward = lm.model.forward
    monkeypatch.setattr(lm.model, "forward", lambda *a: counts.append(torch.get_num_threads()) or forward(*a))
    seqs = [lm.encode(t)[0] for t in TEXTS]
    got = lm.embed(seqs)
    assert counts == [1] if _omp_runtime() is not None else counts == [2]
    ids, mask = pad_batch(seqs)
    want = pool(forward(ids, mask), mask, lm.config.pooling, lm.config.normalize)  # torch's 2 threads
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5)


def test_dense_encoder_keeps_torch_threads(tmp_path, monkeypatch):
    path = write_encoder_gguf(tmp_path / "f16.gguf", "bert", _bert_state(64, 1, 128), VOCAB, hidden=64, layers=1,
                              heads=4, ffn=128, context=128, pooling_type=1, qtype="F16")
    assert _load(path, monkeypatch, True).forward_threads is None
