"""Issue 33's Llama-family variants (SmolLM3, OLMo 2, OLMo 3, Ministral 3, Granite, Qwen3-VL's text model) on tiny
random models written here as HF safetensors folders and as GGUF files with llama.cpp's names and keys: our
logits against transformers' (float32) through prefill and decode, contiguous cache and paged pool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.loaders.gguf_weights import GGUFWeights
from edgeserve.models.config import ModelConfig, config_from_gguf, config_from_hf
from edgeserve.models.decoders import decoder_class

from support.gguf_writer import write_model_gguf
from support.model_sources import gguf_source, saved_source

transformers = pytest.importorskip("transformers")
from test_more_archs import COMMON, DECODES, PROMPT, contiguous_logits, paged_logits  # noqa: E402

IDS = PROMPT + list(range(40, 40 + DECODES))
ARCHS = ["smollm3", "olmo2", "olmo3", "olmo3-yarn", "mistral3", "mistral3-vl", "granite", "qwen3vl"]
# our architecture name (GGUF general.architecture) of each case
GGUF_ARCH = {"olmo3": "olmo2", "olmo3-yarn": "olmo2", "mistral3-vl": "mistral3"}
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def hf_model(case: str):
    """A tiny random transformers model of `case`, its features made to bite on PROMPT + decodes."""
    torch.manual_seed(0)
    t = transformers
    common = dict(COMMON, **TOKENS)
    if case == "smollm3":  # layer 3 has no RoPE
        cfg = t.SmolLM3Config(num_hidden_layers=5, **common)
    elif case == "olmo2":
        cfg = t.Olmo2Config(num_hidden_layers=2, **common)
    elif case == "olmo3":  # layers 0-2 slide over 5 positions, layer 3 is global
        cfg = t.Olmo3Config(num_hidden_layers=4, sliding_window=5, **common)
    elif case == "olmo3-yarn":  # YaRN on the global layer only
        yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "attention_factor": 1.2,
                "beta_fast": 32.0, "beta_slow": 1.0}
        cfg = t.Olmo3Config(num_hidden_layers=4, sliding_window=5, rope_scaling=yarn, **common)
    elif case.startswith("mistral3"):  # YaRN, and a temperature that grows every 4 positions
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.5}
        cfg = t.Ministral3Config(num_hidden_layers=2, rope_parameters=rope, **common)
        if case == "mistral3-vl":  # the multimodal checkpoint: weights under `language_model.`
            vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, head_dim=16, patch_size=4, image_size=16)
            cfg = t.Mistral3Config(text_config=cfg.to_dict(), vision_config=vision, tie_word_embeddings=False)
    elif case == "granite":
        cfg = t.GraniteConfig(num_hidden_layers=2, embedding_multiplier=3.0, residual_multiplier=0.5,
                              attention_multiplier=0.1, logits_scaling=4.0,
                              **{k: v for k, v in common.items() if k != "head_dim"})
    else:
        text = dict(common, num_hidden_layers=2, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True})
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=HIDDEN_OUT,
                      deepstack_visual_indexes=[0], patch_size=4, temporal_patch_size=2, spatial_merge_size=2)
        cfg = t.Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    multimodal = {"qwen3vl": t.Qwen3VLForConditionalGeneration, "mistral3-vl": t.Mistral3ForConditionalGeneration}
    model = multimodal[case](cfg) if case in multimodal else t.AutoModelForCausalLM.from_config(cfg)
    model.eval()
    with torch.no_grad():  # bigger than the default init, so attention is far from uniform
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5 if "norm" in name else 0.15)
            if "norm" in name:
                p.add_(1.0)
    return model


HIDDEN_OUT = COMMON["hidden_size"]


def write_gguf(model, case: str, path: Path, q8_0: bool = False, drop: str | None = None) -> Path:
    """The model as llama.cpp's converter writes a GGUF of `case` (`q8_0`: matrices as Q8_0 blocks; `drop`: a
    tensor left out)."""
    return write_model_gguf(model, path, GGUF_ARCH.get(case, case), qtype="Q8_0" if q8_0 else "F32",
                            drop=(drop,) if drop else ())


def load_config(model, case: str, tmp_path: Path, source: str):
    """Our config and weights of `model` from an HF folder or a GGUF file."""
    if source == "safetensors":
        return saved_source(model, tmp_path / "hf")
    return gguf_source(write_gguf(model, case, tmp_path / "m.gguf"))


def reference_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].float()


def check_features(case: str, config: ModelConfig) -> None:
    """The config carries what makes `case` differ from Llama (so the parity below exercises it)."""
    if case == "smollm3":
        assert config.rope_layers == (True, True, True, False, True)
    elif case.startswith("olmo"):
        assert config.post_norms and config.qk_norm_full
        assert config.layer_windows == ((5, 5, 5, None) if case.startswith("olmo3") else None)
        if case == "olmo3-yarn":
            assert config.rope_scaling.kind == "yarn" and config.rope_scaling.attention_factor == pytest.approx(1.2)
    elif case.startswith("mistral3"):
        assert config.rope_scaling.kind == "yarn" and config.rope_scaling.attention_factor == 1.0
        assert config.attn_temperature == 0.5 and config.attn_temperature_length == 4
    elif case == "granite":
        assert (config.embed_scale, config.residual_scale, config.query_scale, config.logit_scale) == pytest.approx(
            (3.0, 0.5, 0.1, 4.0))
    else:
        assert config.qk_norm and not config.qk_norm_full


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
@pytest.mark.parametrize("case", ARCHS)
def test_logits_match_transformers(case: str, source: str, tmp_path: Path) -> None:
    ref_model = hf_model(case)
    ref = reference_logits(ref_model)
    config, weights = load_config(ref_model, case, tmp_path, source)
    assert config.architecture == GGUF_ARCH.get(case, case)
    check_features(case, config)
    model = decoder_class(config).from_weights(config, weights, dtype=torch.float32)
    for got in (contiguous_logits(model), paged_logits(model)):
        assert got.shape == ref.shape
        diff = (got - ref).abs().max().item()
        assert diff < 1e-4 * max(1.0, ref.abs().max().item()), f"{case}/{source}: max diff {diff}"


def load_gguf(path: Path):
    g = GGUFFile(path)
    config = config_from_gguf(g.metadata, set(g.tensor_names()))
    return decoder_class(config).from_weights(config, GGUFWeights(g, config.num_heads, config.num_kv_heads))


@pytest.mark.parametrize("case, drop", [("smollm3", "blk.1.attn_q.weight"), ("olmo2", "blk.0.post_ffw_norm.weight"),
                                        ("olmo3", "blk.2.post_ffw_norm.weight"), ("granite", "output_norm.weight")])
def test_a_gguf_missing_a_tensor_is_refused_naming_it(case: str, drop: str, tmp_path: Path) -> None:
    from edgeserve.errors import ModelLoadError

    path = write_gguf(hf_model(case), case, tmp_path / "m.gguf", drop=drop)
    with pytest.raises(ModelLoadError, match=drop.replace(".", r"\.")):
        load_gguf(path)


def test_a_gguf_missing_a_key_is_refused_naming_it(tmp_path: Path) -> None:
    from edgeserve.errors import ModelLoadError

    g = GGUFFile(write_gguf(hf_model("mistral3"), "mistral3", tmp_path / "m.gguf"))
    metadata = {k: v for k, v in g.metadata.items() if k != "mistral3.rope.scaling.original_context_length"}
    with pytest.raises(ModelLoadError, match=r"YaRN scaling needs mistral3\.rope\.scaling\.factor and "
                                             r"\.original_context_length"):
        config_from_gguf(metadata, set(g.tensor_names()))
    metadata = {k: v for k, v in g.metadata.items() if not k.startswith("mistral3.rope.scaling")}
    with pytest.raises(ModelLoadError, match=r"mistral3\.rope\.scaling\.original_context_length"):
        config_from_gguf(metadata, set(g.tensor_names()))  # the temperature's length


def test_what_the_variants_do_not_cover_is_refused_by_name() -> None:
    from edgeserve.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="'qwen3vlmoe'"):
        config_from_gguf({"general.architecture": "qwen3vlmoe"}, set())
    cfg = transformers.SmolLM3Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=8, **COMMON)
    with pytest.raises(UnsupportedModelError, match="SmolLM3 with use_sliding_window"):
        config_from_hf(cfg.to_dict())


def test_dummy_weights_take_the_olmo_block(tmp_path: Path) -> None:
    """`--load-format dummy` of an OLMo 3 config gives OLMo's decoder with its whole-projection Q/K norms."""
    from edgeserve.models.load import load_model
    from edgeserve.models.archs.olmo2.model import Olmo2Model
    from edgeserve.registry import resolve

    path = tmp_path / "olmo3.json"
    path.write_text(json.dumps(hf_model("olmo3").config.to_dict()))
    model = load_model(resolve(str(path)), dtype="float32", load_format="dummy").model
    assert isinstance(model, Olmo2Model) and model.layers[0].q_norm.shape == (model.config.q_size,)
    assert torch.isfinite(contiguous_logits(model)).all()


def test_hf_configs_without_the_per_layer_lists_use_the_default_patterns() -> None:
    """OLMo 3 without `layer_types` slides 3 of every 4 layers; SmolLM3 without `no_rope_layers` drops RoPE every
    `no_rope_layer_interval` layers (transformers' defaults)."""
    olmo = hf_model("olmo3").config.to_dict()
    del olmo["layer_types"]
    assert config_from_hf(olmo).layer_windows == (5, 5, 5, None)
    smol = transformers.SmolLM3Config(num_hidden_layers=6, no_rope_layer_interval=3, **COMMON).to_dict()
    del smol["no_rope_layers"]
    assert config_from_hf(smol).rope_layers == (True, True, False, True, True, False)


def test_olmo2_int4_quantizes_without_calibration_and_refuses_it(tmp_path: Path) -> None:
    """`--quantize int4` of an OLMo folder keeps its logits close; activation-aware calibration, whose scales
    fold into norms OLMo has not, is refused by name."""
    from edgeserve.errors import EdgeserveError
    from edgeserve.loaders.quantize import Int4QuantizingWeights
    from edgeserve.models.calibrate import awq_scales

    config, weights = load_config(hf_model("olmo3"), "olmo3", tmp_path, "safetensors")
    float_model = decoder_class(config).from_weights(config, weights, dtype=torch.float32)
    int4 = decoder_class(config).from_weights(config, Int4QuantizingWeights(weights, 32), dtype=torch.float32)
    got, want = contiguous_logits(int4), contiguous_logits(float_model)
    # 4-bit groups of 32 on a tiny random model are coarse (a Llama-block model of this shape gives about 0.9)
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.9
    with pytest.raises(EdgeserveError, match="olmo2's block"):
        awq_scales(config, weights, IDS, 32, torch.float32, torch.device("cpu"))


def test_an_attention_temperature_without_its_length_is_refused() -> None:
    from edgeserve.errors import ModelLoadError

    cfg = hf_model("mistral3").config.to_dict()
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.1}
    with pytest.raises(ModelLoadError, match="original_max_position_embeddings"):
        config_from_hf(cfg)
