"""The converter-parity table: per architecture we claim, a tiny transformers config with the structural features of
the real checkpoints (layer-type patterns, sliding windows, shared-KV layers, sinks, expert counts, MTP blocks), the
GGUF architecture llama.cpp's converter must write for it, and how the real checkpoint stores its weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from converter_parity import Case, spread
from llama_cpp_source import llama_cpp_dir
import subfolders  # noqa: F401  (the test modules' folders on sys.path)
from support.gguf_writer import write_model_gguf
from test_gpt_oss import write_mxfp4_checkpoint

SLIDING, FULL = "sliding_attention", "full_attention"
LINEAR = "linear_attention"
SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
DENSE = dict(SMALL, intermediate_size=96, num_hidden_layers=2)
QWEN35 = dict(SMALL, num_hidden_layers=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                               "mrope_section": [2, 1, 1], "mrope_interleaved": True})
QWEN35_MOE = dict(QWEN35, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                  shared_expert_intermediate_size=64)
QWEN35_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                     temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
GEMMA4 = dict(SMALL, intermediate_size=96, head_dim=16, global_head_dim=32, sliding_window=5,
              final_logit_softcapping=5.0, tie_word_embeddings=True)
GEMMA4_E2B = dict(GEMMA4, num_hidden_layers=7, num_key_value_heads=1,
                  layer_types=[SLIDING, SLIDING, FULL, SLIDING, FULL, SLIDING, FULL], hidden_size_per_layer_input=8,
                  num_kv_shared_layers=3, use_double_wide_mlp=True, attention_k_eq_v=False)
GEMMA4_MOE = dict(GEMMA4, num_hidden_layers=4, layer_types=[SLIDING, FULL, SLIDING, FULL],
                  hidden_size_per_layer_input=0, num_kv_shared_layers=0, attention_k_eq_v=True,
                  num_global_key_value_heads=1, enable_moe_block=True, num_experts=8, top_k_experts=2,
                  moe_intermediate_size=32)
# Gemma 4 12B's text model (`gemma4_unified`): K = V global layers with their own K/V head count, the last layers
# reading an earlier layer's K/V with a double-wide MLP, no per-layer inputs, no experts; the multimodal class as
# released (`model.language_model.*`, `text_config`), without its image / audio embedders (the GGUF holds the text)
GEMMA4_UNIFIED = dict(GEMMA4, num_hidden_layers=7, layer_types=[SLIDING, SLIDING, FULL, SLIDING, FULL, SLIDING, FULL],
                      num_kv_shared_layers=3, use_double_wide_mlp=True, attention_k_eq_v=True,
                      num_global_key_value_heads=1)
# a Gemma 4 assistant drafter for the gemma4-e2b case's target (its K/V heads, head sizes, window and width): q-only
# layers of both kinds over the target's K/V, its own smaller width, the target's width as `backbone_hidden_size`
GEMMA4_ASSISTANT = dict(GEMMA4, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_key_value_heads=1,
                        layer_types=[SLIDING, SLIDING, FULL], hidden_size_per_layer_input=0,
                        vocab_size_per_layer_input=0, num_kv_shared_layers=3, use_double_wide_mlp=False,
                        final_logit_softcapping=None)
# Gemma 2 / 3 tie their embeddings as the real ones (llama.cpp's Gemma 2 converter drops an untied lm_head.weight)
GEMMA2 = dict(DENSE, num_hidden_layers=3, tie_word_embeddings=True, head_dim=16, sliding_window=5,
              query_pre_attn_scalar=16, attn_logit_softcapping=0.5, final_logit_softcapping=2.0)
GEMMA3 = dict(DENSE, num_hidden_layers=6, tie_word_embeddings=True, head_dim=16, sliding_window=5,
              query_pre_attn_scalar=16, rope_parameters={
                  "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
# the VL models' vision towers, as small as their configs allow (the GGUF holds the text model only)
QWEN_VL_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                      temporal_patch_size=2, spatial_merge_size=2)
# LFM2's pattern of the real 1.2B (attention every few layers, conv first), its MLP-width adjustment at work
# (their configs name the norms' epsilon `norm_eps` only, as the real ones)
LFM2_SMALL = {k: v for k, v in SMALL.items() if k != "rms_norm_eps"} | dict(tie_word_embeddings=True)
LFM2 = dict(LFM2_SMALL, num_hidden_layers=5, norm_eps=1e-5, conv_L_cache=3,
            layer_types=["conv", "conv", FULL, "conv", FULL], intermediate_size=144, block_multiple_of=32,
            block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
# LFM2-8B-A1B's layout: leading dense layers, then experts (sigmoid router, expert bias), conv and attention mixed
LFM2_MOE = dict(LFM2_SMALL, num_hidden_layers=5, norm_eps=1e-5, conv_L_cache=3,
                layer_types=["conv", "conv", FULL, "conv", FULL], intermediate_size=96, moe_intermediate_size=32,
                num_dense_layers=2, num_experts=8, num_experts_per_tok=2, use_expert_bias=True,
                norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
# LFM3-1.7B's layout in small (transformers' default rhythm over 7 layers: conv, conv, global, conv, sliding, conv,
# global), its 7-wide conv cache, proportional RoPE over half of each 32-wide head; a window of 5 tokens so the sliding
# layers' window bites. llama.cpp's converter has no lfm3: its GGUF is ours (support.gguf_writer, archs/lfm3)
LFM3 = dict(LFM2_SMALL, num_hidden_layers=7, norm_eps=1e-5, head_dim=32, intermediate_size=96, sliding_window=5)
# Nemotron-H-8B's block pattern in small (Mamba-2 M, attention *, MLP -), several heads per B / C group (its
# configs name the norms' epsilon `layer_norm_epsilon` only, as the real ones)
NEMOTRON_H = dict({k: v for k, v in SMALL.items() if k != "rms_norm_eps"}, head_dim=16, intermediate_size=96,
                  layer_norm_epsilon=1e-5, hybrid_override_pattern="M-*M-M*-", ssm_state_size=16, mamba_num_heads=8,
                  mamba_head_dim=16, n_groups=2, conv_kernel=4, chunk_size=8)
# Nemotron 3 Nano 30B-A3B's block pattern in small (Mamba-2 M, MoE E, attention *; no plain MLP blocks): 8 routed
# squared-ReLU experts, 2 a token, beside a shared one; the router's correction bias and scaling factor at work
NEMOTRON_H_MOE = dict(NEMOTRON_H, hybrid_override_pattern="MEM*EME*E", n_routed_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, moe_shared_expert_intermediate_size=64, n_group=1, topk_group=1,
                      norm_topk_prob=True, routed_scaling_factor=2.5)
# Granite 4 H Micro's layout in small: Mamba-2 and NoPE attention layers (`layer_types` as released), each with a
# SwiGLU MLP, Granite's multipliers (no experts here; the -moe case adds them); as many KV heads as heads, since
# llama.cpp's converter (reading the config through transformers 5, which renames the layer kinds) writes 0 KV heads
# on every layer
GRANITE_H = dict(SMALL, num_key_value_heads=4, num_hidden_layers=6, shared_intermediate_size=96,
                 layer_types=["mamba", "mamba", "attention", "mamba", "mamba", "attention"], num_local_experts=0,
                 mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=16, mamba_d_head=16, mamba_d_conv=4,
                 mamba_chunk_size=8, position_embedding_type="nope", embedding_multiplier=3.0,
                 residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=4.0)
# Falcon-H1's layer in small: attention (RoPE) and Mamba-2 side by side in every layer, then a SwiGLU MLP, with every
# multiplier away from 1 (folded into the weights by llama.cpp's converter, at load by edgeserve); no Mamba norm, as
# the released configs (`mamba_rms_norm` false)
FALCON_H1 = dict(SMALL, num_hidden_layers=3, head_dim=16, intermediate_size=96, mamba_d_ssm=128, mamba_n_heads=8,
                 mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=8,
                 mamba_rms_norm=False, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                 embedding_multiplier=2.0, lm_head_multiplier=0.5, key_multiplier=0.7, attention_in_multiplier=1.3,
                 attention_out_multiplier=0.8, ssm_in_multiplier=1.2, ssm_out_multiplier=0.9,
                 mlp_multipliers=[1.1, 0.6], ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.7])
GPT_OSS_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096, "rope_theta": 150000.0}


def gemma4_init(model) -> None:
    """Gemma 4's weights far from their init, so attention, soft-capping and the layer scales all bite."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("scale"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)


def spread_with_router_biases(model, suffix: str) -> None:
    """`spread`, and the router's bias buffers (names ending in `suffix`) far enough from 0 to change which experts a
    token gets."""
    spread(model)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith(suffix):
                b.normal_(0.0, 0.3)


def lfm2moe_init(model) -> None:
    """`spread`, and expert biases far enough from 0 to change which experts a token gets."""
    spread_with_router_biases(model, "expert_bias")
def nemotron_h_config(model, folder: Path) -> None:
    """config.json as the released dense checkpoints store it: the block pattern as `hybrid_override_pattern`, no
    MoE keys. (llama.cpp's converter reads it through transformers' AutoConfig, which fills in the MoE defaults, so
    it writes the file as `nemotron_h_moe` with dense blocks only: edgeserve reads that name as an alias.)"""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for key in ("num_experts_per_tok", "n_routed_experts", "n_shared_experts", "moe_intermediate_size",
                "moe_shared_expert_intermediate_size", "moe_latent_size", "moe_shared_expert_overlap", "n_group",
                "topk_group", "norm_topk_prob", "routed_scaling_factor", "mtp_layers_block_type", "layers_block_type"):
        cfg.pop(key, None)
    cfg["hybrid_override_pattern"] = model.config.hybrid_override_pattern
    path.write_text(json.dumps(cfg, indent=2))


def gemma4_unified_folder(model, folder: Path) -> None:
    """The folder as the released checkpoint ships it: Gemma 4's chat template (llama.cpp's copy of the 31B's) as
    chat_template.jinja, and `moe_intermediate_size: null` in the text config: llama.cpp's Gemma 4 converter reads
    that key unconditionally (null: no experts), and transformers 5.24's Gemma4UnifiedTextConfig no longer writes it."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg["text_config"]["moe_intermediate_size"] = None
    path.write_text(json.dumps(cfg, indent=2))
    template = llama_cpp_dir() / "models" / "templates" / "google-gemma-4-31B-it.jinja"
    (folder / "chat_template.jinja").write_text(template.read_text())


def nemotron_h_moe_config(model, folder: Path) -> None:
    """config.json as the released Nemotron 3 Nano stores it: the block pattern as `hybrid_override_pattern`."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("layers_block_type", None)
    cfg["hybrid_override_pattern"] = model.config.hybrid_override_pattern
    path.write_text(json.dumps(cfg, indent=2))


def nemotron_h_moe_init(model) -> None:
    """`spread`, and correction biases far enough from 0 to change which experts a token gets."""
    spread_with_router_biases(model, "e_score_correction_bias")


def gpt_oss_init(model) -> None:
    with torch.no_grad():  # routing, sinks and the clamps all matter
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5 if "norm" in name or "router" in name else (1.0 if "sinks" in name else 0.15))


t = transformers
CASES = [
    # layer kinds off the full_attention_interval rhythm: only `attention.recurrent_layers` tells them
    Case("qwen35", lambda v: t.Qwen3_5TextConfig(**QWEN35, vocab_size=v, intermediate_size=96,
                                                 layer_types=[LINEAR, FULL, LINEAR, LINEAR]),
         "qwen35", ("--no-mtp",)),
    Case("qwen35-mtp", lambda v: t.Qwen3_5TextConfig(**QWEN35, vocab_size=v, intermediate_size=96), "qwen35",
         mtp_layers=1),
    Case("qwen35moe-mtp", lambda v: t.Qwen3_5MoeTextConfig(**QWEN35_MOE, vocab_size=v), "qwen35moe", mtp_layers=1),
    # the layout of the published Qwen3.5 repos: the multimodal class (`model.language_model.*`, `model.visual.*`,
    # `text_config`) with `mtp.*` beside; the GGUF holds the text model
    Case("qwen35-vl-mtp", lambda v: t.Qwen3_5Config(
        text_config=dict(QWEN35, vocab_size=v, intermediate_size=96), vision_config=QWEN35_VISION,
        tie_word_embeddings=False), "qwen35", mtp_layers=1, model_class="Qwen3_5ForConditionalGeneration"),
    Case("qwen3", lambda v: t.Qwen3Config(**DENSE, vocab_size=v, head_dim=32), "qwen3"),
    Case("qwen3moe", lambda v: t.Qwen3MoeConfig(**DENSE, vocab_size=v, head_dim=32, num_experts=8,
                                                num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
         "qwen3moe"),
    Case("llama", lambda v: t.LlamaConfig(**DENSE, vocab_size=v, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}), "llama"),
    # the real 5:1 sliding / global rhythm (llama.cpp's gemma3 knows no other), per-kind RoPE as in Gemma 3 4B+
    Case("gemma3", lambda v: t.Gemma3TextConfig(**GEMMA3, vocab_size=v), "gemma3", tokenizer="spm",
         init=gemma4_init),
    Case("gemma4-e2b", lambda v: t.Gemma4TextConfig(**GEMMA4_E2B, vocab_size=v, vocab_size_per_layer_input=v),
         "gemma4", tokenizer="spm", init=gemma4_init),
    Case("gemma4-26b-a4b", lambda v: t.Gemma4TextConfig(**GEMMA4_MOE, vocab_size=v), "gemma4",
         tokenizer="spm", init=gemma4_init),
    Case("gemma4-12b", lambda v: t.Gemma4UnifiedConfig(text_config=dict(GEMMA4_UNIFIED, vocab_size=v),
                                                        vision_config=None, audio_config=None),
         "gemma4", tokenizer="spm", init=gemma4_init, model_class="Gemma4UnifiedForConditionalGeneration",
         post_save=gemma4_unified_folder, ours="gemma4_unified"),
    # a drafter: its parity with transformers over a target's K/V is tests/models/test_gemma4_assistant.py's
    Case("gemma4-assistant", lambda v: t.Gemma4AssistantConfig(text_config=dict(GEMMA4_ASSISTANT, vocab_size=v),
                                                               backbone_hidden_size=GEMMA4["hidden_size"]),
         "gemma4-assistant", tokenizer="spm", init=gemma4_init, model_class="Gemma4AssistantForCausalLM"),
    Case("gpt-oss", lambda v: t.GptOssConfig(**DENSE, vocab_size=v, head_dim=16, num_local_experts=4,
                                             num_experts_per_tok=2, sliding_window=5,
                                             rope_parameters=dict(GPT_OSS_YARN)),
         "gpt-oss", init=gpt_oss_init,
         post_save=write_mxfp4_checkpoint),  # MXFP4 experts as OpenAI's checkpoint stores them
    Case("qwen2", lambda v: t.Qwen2Config(**DENSE, vocab_size=v), "qwen2"),
    Case("phi3", lambda v: t.Phi3Config(**DENSE, vocab_size=v), "phi3", tokenizer="spm"),
    Case("olmo2", lambda v: t.Olmo2Config(**DENSE, vocab_size=v), "olmo2"),
    Case("smollm3", lambda v: t.SmolLM3Config(**DENSE | dict(num_hidden_layers=4), vocab_size=v), "smollm3"),
    Case("mistral3", lambda v: t.Ministral3Config(**DENSE, vocab_size=v, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5}),
         "mistral3"),
    Case("granite", lambda v: t.GraniteConfig(**DENSE, vocab_size=v, embedding_multiplier=3.0,
                                              residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=4.0),
         "granite"),
    Case("gemma2", lambda v: t.Gemma2Config(**GEMMA2, vocab_size=v), "gemma2", tokenizer="spm", init=gemma4_init),
    # llama.cpp converts Mistral as llama (no window key; the real configs have none)
    Case("mistral", lambda v: t.MistralConfig(**DENSE, vocab_size=v, sliding_window=None), "llama", ours="mistral"),
    # the VL checkpoints' text models (`model.language_model.*`): M-RoPE, which for text alone is 1-D RoPE
    Case("qwen3vl", lambda v: t.Qwen3VLConfig(
        text_config=dict(DENSE, vocab_size=v, head_dim=32, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 4, 4], "mrope_interleaved": True}),
        vision_config=dict(QWEN_VL_VISION, deepstack_visual_indexes=[0]), tie_word_embeddings=False), "qwen3vl",
        model_class="Qwen3VLForConditionalGeneration"),
    Case("qwen2vl", lambda v: t.Qwen2_5_VLConfig(
        text_config=dict(DENSE, vocab_size=v, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(QWEN_VL_VISION, fullatt_block_indexes=[0], window_size=16), tie_word_embeddings=False),
        "qwen2vl", model_class="Qwen2_5_VLForConditionalGeneration"),
    Case("lfm2", lambda v: t.Lfm2Config(**LFM2, vocab_size=v), "lfm2"),
    Case("lfm2moe", lambda v: t.Lfm2MoeConfig(**LFM2_MOE, vocab_size=v), "lfm2moe", init=lfm2moe_init),
    Case("lfm3", lambda v: t.Lfm3Config(**LFM3, vocab_size=v), "lfm3",
         writer=lambda model, path, qtype: write_model_gguf(model, path, "lfm3", qtype=qtype)),
    Case("nemotron_h", lambda v: t.NemotronHConfig(**NEMOTRON_H, vocab_size=v), "nemotron_h",
         model_class="NemotronHForCausalLM", post_save=nemotron_h_config),
    # transformers saves the experts one by one (`mixer.experts.N.up_proj.weight`), as the released checkpoint
    Case("nemotron_h_moe", lambda v: t.NemotronHConfig(**NEMOTRON_H_MOE, vocab_size=v), "nemotron_h_moe",
         model_class="NemotronHForCausalLM", init=nemotron_h_moe_init, post_save=nemotron_h_moe_config),
    Case("granitehybrid", lambda v: t.GraniteMoeHybridConfig(**GRANITE_H, vocab_size=v), "granitehybrid",
         model_class="GraniteMoeHybridForCausalLM"),
    Case("falcon-h1", lambda v: t.FalconH1Config(**FALCON_H1, vocab_size=v), "falcon-h1",
         model_class="FalconH1ForCausalLM"),
    # Granite 4 H Tiny's: 8 experts (2 a token, 32 wide: Q8_0 blocks for the native MoE layer) beside the 96-wide MLP
    Case("granitehybrid-moe", lambda v: t.GraniteMoeHybridConfig(**GRANITE_H | dict(
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=32), vocab_size=v), "granitehybrid",
         model_class="GraniteMoeHybridForCausalLM"),
]
BY_NAME = {c.name: c for c in CASES}
