"""Issue 33's variants on a CUDA device (Triton kernels where they apply) in bfloat16, against transformers' float32
logits on the CPU: prompt in two chunks, then decodes, through a paged pool on the device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention
from edgeserve.kernels.dispatch import AttentionMetadata
from edgeserve.loaders.hf_folder import HFFolder
from edgeserve.models.config import config_from_hf
from edgeserve.models.decoders import decoder_class

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers")
from test_variant_archs import ARCHS, IDS, PROMPT, hf_model, reference_logits  # noqa: E402


@pytest.mark.parametrize("case", ARCHS)
def test_cuda_logits_follow_transformers(case: str, tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    ref_model = hf_model(case)
    ref = reference_logits(ref_model)
    ref_model.save_pretrained(tmp_path / "hf")
    config = config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    model = decoder_class(config).from_weights(config, HFFolder(tmp_path / "hf").weights(), dtype=torch.bfloat16,
                                               device="cuda")
    pool = KVPool(config, 8, 16, torch.bfloat16, device="cuda")
    table = list(range(8))
    steps = [(0, 5), (5, len(PROMPT))] + [(p, p + 1) for p in range(len(PROMPT), len(IDS))]
    out = []
    for a, b in steps:
        meta = AttentionMetadata.build([b - a], [b], [table], list(range(a, b)), device="cuda")
        ids, positions = torch.tensor(IDS[a:b], device="cuda"), torch.arange(a, b, device="cuda")
        out.append(model.logits(model.forward(ids, positions, PagedKVAttention(pool, meta))).float().cpu())
    got = torch.cat(out)
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    assert cos.min() > 0.99, f"{case}: cosine similarity per row {cos.tolist()}"
