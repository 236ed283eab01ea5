"""Qwen3.5 hybrids (dense and MoE) against transformers in float32 on tiny random models: from an HF folder and
from qwen35 / qwen35moe GGUFs (F32, F16, Q8_0), logits through a chunked prefill and decode steps, with other
sequences beside them in the batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from edgeserve.errors import ModelLoadError
from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.loaders.gguf_weights import GGUFWeights
from edgeserve.loaders.hf_folder import HFFolder
from edgeserve.models.config import config_from_gguf, config_from_hf
from edgeserve.models.decoders import decoder_class
from edgeserve.kernels.torch.rope import rope_permutation
from edgeserve.models.qwen35 import Qwen35Model, partial_rope_inv_freq

from qwen35_helpers import DECODES, PROMPT, hf_qwen35, reference_logits, run_steps, write_qwen35_gguf

pytest.importorskip("transformers")

IDS = PROMPT + list(range(40, 40 + DECODES))
# the prompt in two chunks (7, then 6: across a block and the chunked / recurrent kernels' switch), then decodes
STEPS = [(0, 7), (7, len(PROMPT))] + [(p, p + 1) for p in range(len(PROMPT), len(IDS))]


def load_ours(source: str, model, tmp_path: Path, qtype: str = "F32", rounded: str | None = None) -> Qwen35Model:
    if source == "hf":
        model.save_pretrained(tmp_path / "hf")
        config = config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
        weights = HFFolder(tmp_path / "hf").weights()
    else:
        g = GGUFFile(write_qwen35_gguf(model, tmp_path / f"m-{qtype}-{rounded}.gguf", qtype, rounded=rounded))
        config = config_from_gguf(g.metadata, set(g.tensor_names()))
        weights = GGUFWeights(g, config.num_heads, config.num_kv_heads)
    assert decoder_class(config) is Qwen35Model
    return Qwen35Model.from_weights(config, weights, dtype=torch.float32)


def our_logits(ours: Qwen35Model) -> torch.Tensor:
    """IDS through STEPS, with a second sequence (another slot and blocks) in every step."""
    other = [3, 90, 91, 92, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    steps = [[s, (min(i * 3, 18), min(i * 3 + 3, 19))] for i, s in enumerate(STEPS)]
    return run_steps(ours, steps, [IDS, other])[0]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_logits_match_transformers(moe: bool, source: str, tmp_path: Path) -> None:
    model = hf_qwen35(moe)
    ref = reference_logits(model, IDS)
    ours = our_logits(load_ours(source, model, tmp_path))
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 2e-4


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("qtype", ["F16", "Q8_0"])
def test_stored_types_load_as_their_values(moe: bool, qtype: str, tmp_path: Path) -> None:
    """A GGUF with F16 / Q8_0 matrices gives the logits of an F32 GGUF holding the same rounded values (whose path
    matches transformers above)."""
    model = hf_qwen35(moe)
    ours = our_logits(load_ours("gguf", model, tmp_path, qtype))
    exact = our_logits(load_ours("gguf", model, tmp_path, "F32", rounded=qtype))
    assert (ours - exact).abs().max().item() < 2e-4


def test_config_reads_the_hybrid_fields(tmp_path: Path) -> None:
    model = hf_qwen35(moe=True)
    hf = config_from_hf(model.config.to_dict())
    g = GGUFFile(write_qwen35_gguf(model, tmp_path / "m.gguf"))
    gg = config_from_gguf(g.metadata, set(g.tensor_names()))
    for c in (hf, gg):
        assert c.architecture == "qwen35moe" and c.is_hybrid and c.is_moe
        assert c.linear_layers == (True, True, True, False) and c.num_linear_layers == 3
        assert (c.delta.num_k_heads, c.delta.num_v_heads, c.delta.head_k_dim, c.delta.head_v_dim) == (2, 4, 16, 8)
        assert c.rotary_dim == 8 and c.attn_output_gate and c.norm_topk_prob and c.shared_expert_intermediate_size == 64
    assert not hf.delta.tiled and gg.delta.tiled  # llama.cpp's GGUF keeps value heads tiled
    assert hf.norm_offset == 1.0 and gg.norm_offset == 0.0  # the converter writes 1 + w
    multimodal = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                  "text_config": model.config.to_dict()}
    assert config_from_hf(multimodal) == hf


def test_multimodal_checkpoint_loads_its_language_model(tmp_path: Path) -> None:
    """A Qwen3_5ForConditionalGeneration folder: text_config, weights under model.language_model.*."""
    from safetensors.torch import load_file, save_file

    model = hf_qwen35()
    model.save_pretrained(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    sd = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v for k, v in sd.items()}
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = config_from_hf({"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
                             "text_config": model.config.to_dict()})
    ours = Qwen35Model.from_weights(config, HFFolder(tmp_path).weights())
    assert (our_logits(ours) - reference_logits(model, IDS)).abs().max() < 2e-4


def test_partial_rope_permutation_pairs() -> None:
    perm = rope_permutation(32, 8)
    assert sorted(perm.tolist()) == list(range(32))
    # rotated pairs (i, i + 4) of the first 8 dims sit at (j, j + 16)
    assert [(int(perm[j]), int(perm[j + 16])) for j in range(4)] == [(i, i + 4) for i in range(4)]
    inv = partial_rope_inv_freq(32, 8, 10000.0)
    assert inv.shape == (16,) and bool((inv[4:] == 0).all()) and bool((inv[:4] > 0).all())
    assert torch.equal(rope_permutation(16, 16), torch.arange(16))


def test_gguf_missing_a_tensor_is_named(tmp_path: Path) -> None:
    g = GGUFFile(write_qwen35_gguf(hf_qwen35(), tmp_path / "m.gguf", skip="blk.1.ssm_a"))
    config = config_from_gguf(g.metadata, set(g.tensor_names()))
    with pytest.raises(ModelLoadError, match="blk.1.ssm_a"):
        Qwen35Model.from_weights(config, GGUFWeights(g, config.num_heads, config.num_kv_heads))


def test_gguf_metadata_missing_a_key_is_named(tmp_path: Path) -> None:
    g = GGUFFile(write_qwen35_gguf(hf_qwen35(), tmp_path / "m.gguf"))
    meta = {k: v for k, v in g.metadata.items() if k != "qwen35.ssm.time_step_rank"}
    with pytest.raises(ModelLoadError, match="qwen35.ssm.time_step_rank"):
        config_from_gguf(meta, set(g.tensor_names()))


def test_gguf_layer_counts_and_kinds_from_nextn_and_recurrent_layers(tmp_path: Path) -> None:
    """block_count includes the converter's MTP blocks (`nextn_predict_layers`); `attention.recurrent_layers` (one flag
    a block, MTP ones included) sets the layer kinds over `full_attention_interval`; nonsense is refused by name."""
    g = GGUFFile(write_qwen35_gguf(hf_qwen35(), tmp_path / "m.gguf"))
    meta = dict(g.metadata, **{"qwen35.block_count": 5, "qwen35.nextn_predict_layers": 1,
                               "qwen35.attention.recurrent_layers": [True, False, True, True, False]})
    c = config_from_gguf(meta, set(g.tensor_names()))
    assert (c.num_layers, c.mtp_layers, c.linear_layers) == (4, 1, (True, False, True, True))
    with pytest.raises(ModelLoadError, match="nextn_predict_layers 5 does not fit block_count 5"):
        config_from_gguf(dict(meta, **{"qwen35.nextn_predict_layers": 5}), set(g.tensor_names()))
    with pytest.raises(ModelLoadError, match="recurrent_layers lists 3 layers"):
        config_from_gguf(dict(meta, **{"qwen35.attention.recurrent_layers": [True] * 3}), set(g.tensor_names()))


def test_block_bytes_carry_the_partial_rope_row_order(tmp_path: Path) -> None:
    """The native kernels' block bytes of q_proj / k_proj (and the Q/K norms) come in the same permuted row order
    as the dense tensors."""
    from edgeserve.loaders.dequant import dequantize
    from edgeserve.models.qwen35 import Qwen35Weights

    g = GGUFFile(write_qwen35_gguf(hf_qwen35(), tmp_path / "m.gguf", "Q8_0"))
    config = config_from_gguf(g.metadata, set(g.tensor_names()))
    src = Qwen35Weights(GGUFWeights(g, config.num_heads, config.num_kv_heads), config)
    raw = GGUFWeights(g, config.num_heads, config.num_kv_heads)
    for proj in ("q_proj", "k_proj"):
        name = f"model.layers.3.self_attn.{proj}.weight"
        blocks = src.blocks(name)
        dense = src.get(name, keep_int4=False)
        assert torch.equal(dequantize(blocks.data.numpy(), blocks.qtype, blocks.shape), dense)
        assert not torch.equal(dense, raw.get(name, keep_int4=False))  # permuted


def test_bf16_untied_embeddings_stay_bf16_and_logits_near_float32(tmp_path: Path) -> None:
    """At bfloat16 the untied embedding table (lookups only) keeps bfloat16 rows, not per-row int8 (issue 54:
    int8 rows were most of Qwen3.5's bf16 drift), and the served logits stay near float32's: max |logprob diff|
    0.12 measured (0.74 with int8 rows)."""
    from edgeserve.models.weight_loader import table_rows

    model = hf_qwen35(False)
    model.save_pretrained(tmp_path / "hf")
    config = config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    f32, bf = (Qwen35Model.from_weights(config, HFFolder(tmp_path / "hf").weights(), dtype=dt)
               for dt in (torch.float32, torch.bfloat16))
    ids = torch.tensor(IDS)
    rows = model.get_input_embeddings().weight.detach()[ids]
    assert torch.equal(table_rows(bf.embed, ids), rows.bfloat16().float())
    diff = (our_logits(bf).log_softmax(-1) - our_logits(f32).log_softmax(-1)).abs().max().item()
    assert diff < 0.3


def test_bf16_block_matmuls_read_float32_activations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At bfloat16 on the CPU, a Q8_0 file's matmuls (which quantize their input to int8 blocks themselves) read
    the float32 normed rows, not a bf16 copy of them, per op and in the fused stack (issue 54: rounding twice was
    0.09 of the 0.57 nats a widened Qwen3.5 MoE's Q8_0 file drifted from float32; llama.cpp keeps them float32)."""
    from edgeserve.kernels.cpu.native import BlockWeight

    g = GGUFFile(write_qwen35_gguf(hf_qwen35(True), tmp_path / "m.gguf", "Q8_0"))
    config = config_from_gguf(g.metadata, set(g.tensor_names()))
    bf = Qwen35Model.from_weights(config, GGUFWeights(g, config.num_heads, config.num_kv_heads), dtype=torch.bfloat16)
    assert isinstance(bf.lm_head, BlockWeight) and bf.dtype == torch.bfloat16
    seen: list[torch.dtype] = []
    matmul = BlockWeight.matmul
    monkeypatch.setattr(BlockWeight, "matmul", lambda self, x, out=None: seen.append(x.dtype) or matmul(self, x, out))
    bf._native = None  # the per-op path
    our_logits(bf)
    assert seen and set(seen) == {torch.float32}
    bf._native = False  # the fused stack, planned again
    plan = bf.native_decoder()
    assert plan is not None and plan.decoder.act_bf16 == 0 and plan.act_dtype == torch.float32
