"""The vision towers' native CPU forward (edgeserve/vision/native_vit.py: bfloat16 / quantized matmuls with q, k, v
fused, the encoders' attention kernel, native bias + GELU) against the torch forward of the same matrices, for a
Gemma 3 tower (head size 72, as SigLIP so400m's) and a SmolVLM one whose tiles go through in groups."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from edgeserve.bench.random_mmproj import write_siglip_mmproj
from edgeserve.kernels.formats.bf16_weight import Bf16Weight, bf16_library
from edgeserve.kernels.cpu.native import BlockWeight
from edgeserve.kernels.cpu.encoder_attention import attention_library
from edgeserve.vision.family import load_vision
from vision_helpers import picture

pytestmark = pytest.mark.skipif(bf16_library() is None or attention_library(72) is None,
                                reason="needs the native library's AVX-512 BF16 build")

GEMMA = dict(kind="gemma3", hidden=288, ffn=160, layers=2, heads=4, patch=8, image=64, lm=48)
SMOLVLM = dict(kind="idefics3", hidden=64, ffn=96, layers=2, heads=2, patch=8, image=32, lm=40, scale=2, longest=64)


def _close(native, reference, tol):
    """Equal within float noise: bfloat16 matrices round their float32 inputs, so a last-bit difference upstream
    seldom shows (most values come out the same bits) and now and then moves an input by one bfloat16 step (about
    1e-3 of the largest value here); the mean difference stays far below that."""
    scale = reference.abs().max().item()
    diff = (native - reference).abs()
    assert diff.max().item() <= tol * scale, (diff.max().item(), scale)
    assert diff.mean().item() <= tol * scale / 10, (diff.mean().item(), scale)


def _both_paths(family, prepared):
    """The family's encoding with the tower's native forward, then with torch's over the same matrices."""
    assert family.tower.runs_natively
    native = family.encode(prepared)
    family.tower.native = False
    try:
        reference = family.encode(prepared)
    finally:
        family.tower.native = True
    return native, reference


# Q8_0 quantizes each matmul's activations to 8 bits: a float-noise difference in them can move a value to the next
# step, so the two forwards agree to about 1% there
@pytest.mark.parametrize("qtype,kind,tol", [("F16", Bf16Weight, 3e-3), ("Q8_0", BlockWeight, 2e-2)])
def test_gemma3_tower_natively_equals_the_torch_forward(tmp_path, monkeypatch, qtype, kind, tol):
    monkeypatch.setattr("edgeserve.vision.native_vit.ROWS_PER_CALL", 24)  # 64 patches: matmuls in 3 calls
    path = write_siglip_mmproj(tmp_path / f"mmproj-{qtype}.gguf", GEMMA, qtype)
    family = load_vision(path, SimpleNamespace(hidden_size=48), dtype=torch.bfloat16)
    assert isinstance(family.tower.weights.layers[0].qkv, kind)
    assert family.tower.weights.layers[0].qkv.shape[0] == 3 * 288  # q, k, v one matrix
    img = Image.open(io.BytesIO(picture(57, 43, seed=3))).convert("RGB")
    (native,), (reference,) = _both_paths(family, [family.preprocess(img)])
    assert native.shape == (4, 48)
    # the same matrices: only the attention's and GELU's float32 arithmetic differs
    _close(native, reference, tol)
    exact = load_vision(path, SimpleNamespace(hidden_size=48), dtype=torch.float32)
    assert not exact.tower.runs_natively
    (want,) = exact.encode([exact.preprocess(img)])
    assert (native - want).abs().max() < 0.05 * want.abs().max()  # bfloat16 / Q8_0 matrices against float32


def test_smolvlm_tiles_go_through_in_groups_with_the_same_result(tmp_path, monkeypatch):
    path = write_siglip_mmproj(tmp_path / "mmproj-smol.gguf", SMOLVLM, "F16")
    family = load_vision(path, SimpleNamespace(hidden_size=40), dtype=torch.bfloat16)
    img = Image.open(io.BytesIO(picture(70, 50, seed=4))).convert("RGB")
    prepared = [family.preprocess(img)]
    frames = prepared[0].pixel_values.shape[0]
    assert frames > 2  # tiles and the global view
    monkeypatch.setattr("edgeserve.vision.native_vit.GROUP_TOKENS", 32)  # 2 tiles of 16 patches a group
    monkeypatch.setattr("edgeserve.vision.native_vit.ROWS_PER_CALL", 24)
    (native,), (reference,) = _both_paths(family, prepared)
    _close(native, reference, 3e-3)


def test_kept_layers_and_an_abandoned_encode(tmp_path):
    from edgeserve.vision.stop import EncodeAbandoned, checking
    from edgeserve.vision.vit import patchify

    path = write_siglip_mmproj(tmp_path / "mmproj.gguf", GEMMA, "F16")
    tower = load_vision(path, SimpleNamespace(hidden_size=48), dtype=torch.bfloat16).tower
    patches = patchify(torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(5)), 8)
    out, kept = tower.forward(patches, keep_layers=(0, 1))
    tower.native = False
    want, want_kept = tower.forward(patches, keep_layers=(0, 1))
    tower.native = True
    assert len(kept) == 2
    for a, b in zip([out, *kept], [want, *want_kept]):
        _close(a, b, 3e-3)
    with pytest.raises(EncodeAbandoned), checking(lambda: True):
        tower.forward(patches)
