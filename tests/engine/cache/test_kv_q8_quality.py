"""What the q8_0 KV cache costs in quality on real models: next-token KL divergence against the bf16 KV cache over
a fixed text, on the default model and Gemma 3 270M (head sizes 64 and 256, sliding-window layers), stays under
a stated bound with top-1 agreement above a stated rate (docs/perf-log/2026-11-to-12.md has the measured values: mean KL
about 0.005 and about 94% agreement on 512 to 2048 tokens)."""

from __future__ import annotations

import pytest

from edgeserve.bench.kv_quality import kv_divergence
from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.models.load import load_model
from edgeserve.registry import resolve

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no native CPU kernels here")

TEXT = ("The printing press changed how knowledge travelled. Before it, a book was copied by hand, letter by letter, "
        "and a monastery might spend a year on a single bible. Gutenberg's movable type made it possible to print "
        "hundreds of identical pages in a day. Within fifty years, presses were running in more than two hundred "
        "European cities, and millions of books had been printed. Prices fell, literacy rose, and ideas that once "
        "reached a few scholars could now reach merchants, craftsmen and students. Scientists shared results "
        "quickly and argued about them in print; reformers spread pamphlets faster than authorities could ban "
        "them. Standard spelling and grammar followed, because printers wanted one form of each word for their "
        "readers across many regions. ") * 3
MEAN_KL_BOUND = 0.02  # nats per position
TOP1_BOUND = 0.88


@pytest.mark.parametrize("model", ["default", "gemma3-270m"])
def test_q8_0_kv_stays_close_to_bf16(model, default_model_path):
    if model == "default":
        path = default_model_path
    else:
        from edgeserve.registry import pull

        path = pull("gemma3-270m", progress=False)
    lm = load_model(resolve(str(path)))
    ids = lm.tokenizer.encode(TEXT)[:256]
    d = kv_divergence(lm, ids, candidate="q8_0", reference="auto", chunk=128)
    assert d.positions == len(ids) == 256
    assert d.mean_kl < MEAN_KL_BOUND, d
    assert d.top1_agreement > TOP1_BOUND, d
    assert d.mean_kl > 0  # the q8_0 pool is what the candidate read


def test_fp8_kv_format_stays_close_to_bf16(default_model_path):
    """The fp8 format (e4m3, a float32 scale per row; written and read by the torch twins here, by the Triton
    kernels on a GPU) on the default model: about twice q8_0's KL (3 mantissa bits), under twice its bound."""
    lm = load_model(resolve(str(default_model_path)))
    ids = lm.tokenizer.encode(TEXT)[:256]
    d = kv_divergence(lm, ids, candidate="fp8", reference="auto", chunk=128)
    assert d.positions == 256
    assert 0 < d.mean_kl < 2 * MEAN_KL_BOUND, d
    assert d.top1_agreement > TOP1_BOUND - 0.03, d
