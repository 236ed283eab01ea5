"""benchmarks/quality/beside_llama_server.py's fixes of per-layer counts in converted files: llama.cpp's converter
under transformers 5 writes 0 KV heads on every granitehybrid layer (llama-server refuses the file, and no reader can
know a GQA) and a dense Nemotron-H as `nemotron_h_moe` with 0 MLP widths (llama-server takes its MLP blocks for
Mamba-2 ones); the fixes write the counts in place, after which edgeserve still reads transformers' logits."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from converter_cases import BY_NAME, GRANITE_H  # noqa: E402
from converter_parity import build_checkpoint, convert, load_ours, our_logits, reference_logits  # noqa: E402

from edgeserve.errors import ModelLoadError  # noqa: E402
from edgeserve.loaders.gguf_file import GGUFFile  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "quality"))


def test_a_gqa_granite_file_loads_after_its_kv_heads_are_written_in(tmp_path, tokenizer_dirs):
    import transformers

    from beside_llama_server import granite_kv_heads

    base = BY_NAME["granitehybrid"]
    case = dataclasses.replace(base, name="granitehybrid-gqa", config=lambda v: transformers.GraniteMoeHybridConfig(
        **GRANITE_H | dict(num_key_value_heads=2), vocab_size=v))  # 4 heads, 2 KV heads
    model = build_checkpoint(case, tokenizer_dirs(case.tokenizer), tmp_path / "hf")
    gguf = convert(tmp_path / "hf", tmp_path / "g.f32.gguf", *case.convert_args)
    assert set(GGUFFile(gguf).metadata["granitehybrid.attention.head_count_kv"]) == {0}  # the converter's
    with pytest.raises(ModelLoadError, match="KV heads"):
        load_ours(gguf)
    granite_kv_heads(gguf)
    assert GGUFFile(gguf).metadata["granitehybrid.attention.head_count_kv"] == [0, 0, 2, 0, 0, 2]
    loaded = load_ours(gguf)
    assert loaded.config.num_kv_heads == 2
    ours, ref = our_logits(loaded.model), reference_logits(model)
    assert (ours - ref).abs().max().item() < 1e-3


def test_a_dense_nemotron_file_gets_its_mlp_widths_and_no_experts(checkpoints, reference):
    from beside_llama_server import nemotron_layer_counts

    _, _, converted = checkpoints("nemotron_h")
    gguf = converted.with_name("fixed-" + converted.name)
    gguf.write_bytes(converted.read_bytes())
    m = GGUFFile(gguf).metadata
    arch = m["general.architecture"]
    assert set(m[f"{arch}.feed_forward_length"]) == {0}  # the converter's
    nemotron_layer_counts(gguf)
    f = GGUFFile(gguf)
    widths = f.metadata[f"{arch}.feed_forward_length"]
    mlp = [i for i in range(len(widths)) if f"blk.{i}.ffn_up.weight" in f.tensor_names()]
    assert mlp and all(widths[i] > 0 for i in mlp) and all(w == 0 for i, w in enumerate(widths) if i not in mlp)
    assert f.metadata.get(f"{arch}.expert_count", 0) == 0
    ours = our_logits(load_ours(gguf).model)
    assert (ours - reference("nemotron_h")).abs().max().item() < 1e-3
