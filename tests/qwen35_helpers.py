"""Tiny random Qwen3.5 hybrids (dense and MoE) from transformers, written as HF folders and as qwen35 / qwen35moe
GGUFs the way llama.cpp's converter writes them (1 + w norms, -exp(A_log), squeezed conv, tiled value heads), and
runners of our model over a paged KV pool and a state pool."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from edgeserve.engine.kv_cache import KVPool, PagedKVAttention
from edgeserve.engine.state_pool import StatePool, StateSpec, StepStates
from edgeserve.kernels.dispatch import AttentionMetadata

from tiny_gguf import byte_vocab

TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_vocab() + ["he", "ll", "hell"]
VOCAB, HIDDEN, LAYERS = len(TOKENS), 64, 4
EXPERTS, TOP_K, EXPERT_FFN, SHARED_FFN = 8, 2, 32, 64
PROMPT = [1, 5, 17, 33, 2, 60, 7, 81, 100, 12, 250, 9, 44]
DECODES = 5


def hf_qwen35(moe: bool = False, seed: int = 0):
    """A tiny float32 Qwen3_5ForCausalLM (or Qwen3_5MoeForCausalLM): layers linear, linear, linear, full; heads of 32
    with RoPE on 8 of them; 2 key / 4 value DeltaNet heads; weights scaled so every part matters, the DeltaNet decay
    slow so its state is remembered over many tokens."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                  max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                   "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    torch.manual_seed(seed)
    if moe:
        cfg = transformers.Qwen3_5MoeTextConfig(**common, moe_intermediate_size=EXPERT_FFN, num_experts=EXPERTS,
                                                 num_experts_per_tok=TOP_K, shared_expert_intermediate_size=SHARED_FFN)
        cfg._attn_implementation = "eager"
        model = transformers.Qwen3_5MoeForCausalLM(cfg).eval()
    else:
        cfg = transformers.Qwen3_5TextConfig(**common, intermediate_size=96)
        cfg._attn_implementation = "eager"
        model = transformers.Qwen3_5ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # slow decay: a state carries far (a lost or wrong state shows)
                p.uniform_(-4.0, -1.5)
            elif name.endswith("dt_bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.normal_(0.0 if "linear_attn.norm" not in name else 1.0, 0.3)
            elif "mlp.gate" in name:
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.15)
    return model


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def tiled_order(x: torch.Tensor, dim: int, hk: int, group: int, head: int = 1) -> torch.Tensor:
    """x with its value heads along `dim` (blocks of `head` values) moved from grouped (HF) to tiled (GGUF) order."""
    shape = list(x.shape)
    dim = dim % len(shape)
    x = x.reshape(*shape[:dim], hk, group, head, *shape[dim + 1:]).transpose(dim, dim + 1)
    return x.reshape(shape)


_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}


def llama_cpp_tensors(model) -> dict[str, torch.Tensor]:
    """The model's tensors under llama.cpp's qwen35 / qwen35moe names, converted as its converter does."""
    c = model.config
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    hk, group = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads
    dv, kd = c.linear_value_head_dim, c.linear_num_key_heads * c.linear_key_head_dim
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"] + 1,
           "output.weight": sd["lm_head.weight"]}
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for hf, g in _NAMES.items():
            if p + hf + ".weight" in sd:
                w = sd[p + hf + ".weight"]
                out[b + g + ".weight"] = w + 1 if hf.endswith("norm") else w
                if hf == "mlp.shared_expert_gate":  # 1-D [hidden], as llama.cpp reads it
                    out[b + g + ".weight"] = w.reshape(-1)
        a = p + "linear_attn."
        if a + "A_log" in sd:
            qkv = sd[a + "in_proj_qkv.weight"].clone()
            qkv[2 * kd:] = tiled_order(qkv[2 * kd:], 0, hk, group, dv)
            conv = sd[a + "conv1d.weight"][:, 0].clone()
            conv[2 * kd:] = tiled_order(conv[2 * kd:], 0, hk, group, dv)
            out[b + "attn_qkv.weight"] = qkv
            out[b + "ssm_conv1d.weight"] = conv
            out[b + "attn_gate.weight"] = tiled_order(sd[a + "in_proj_z.weight"], 0, hk, group, dv)
            out[b + "ssm_beta.weight"] = tiled_order(sd[a + "in_proj_b.weight"], 0, hk, group)
            out[b + "ssm_alpha.weight"] = tiled_order(sd[a + "in_proj_a.weight"], 0, hk, group)
            out[b + "ssm_a"] = tiled_order(-sd[a + "A_log"].exp(), 0, hk, group)
            out[b + "ssm_dt.bias"] = tiled_order(sd[a + "dt_bias"], 0, hk, group)
            out[b + "ssm_norm.weight"] = sd[a + "norm.weight"]
            out[b + "ssm_out.weight"] = tiled_order(sd[a + "out_proj.weight"], 1, hk, group, dv)
        if p + "mlp.experts.gate_up_proj" in sd:
            gate, up = sd[p + "mlp.experts.gate_up_proj"].chunk(2, dim=1)
            out[b + "ffn_gate_exps.weight"], out[b + "ffn_up_exps.weight"] = gate, up
            out[b + "ffn_down_exps.weight"] = sd[p + "mlp.experts.down_proj"]
    return out


def write_qwen35_gguf(model, path: Path, qtype: str = "F32", skip: str | None = None,
                      rounded: str | None = None) -> Path:
    """The model as a qwen35 / qwen35moe GGUF with a byte-level tokenizer; 2-D matrices (not norms, router, conv)
    stored as `qtype`; `skip`: a tensor name left out (to test the error); `rounded`: those matrices stored as F32
    after a round trip through that type (the exact values a `qtype` file of it holds)."""
    import gguf

    c = model.config
    moe = hasattr(c, "num_experts")
    arch = "qwen35moe" if moe else "qwen35"
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    w.add_uint32(f"{arch}.full_attention_interval", 4)
    w.add_uint32(f"{arch}.ssm.conv_kernel", c.linear_conv_kernel_dim)
    w.add_uint32(f"{arch}.ssm.state_size", c.linear_key_head_dim)
    w.add_uint32(f"{arch}.ssm.group_count", c.linear_num_key_heads)
    w.add_uint32(f"{arch}.ssm.time_step_rank", c.linear_num_value_heads)
    w.add_uint32(f"{arch}.ssm.inner_size", c.linear_num_value_heads * c.linear_value_head_dim)
    if moe:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_uint32(f"{arch}.expert_shared_feed_forward_length", c.shared_expert_intermediate_size)
    else:
        w.add_feed_forward_length(c.intermediate_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(TOKENS)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(TOKENS) - 3))
    w.add_token_merges(["h e", "l l", "he ll"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    for name, t in llama_cpp_tensors(model).items():
        if name == skip:
            continue
        data = t.numpy().astype(np.float32)
        small = t.dim() < 2 or "norm" in name or "ffn_gate_inp" in name or "conv1d" in name
        if rounded is not None and not small:
            kind = gguf.GGMLQuantizationType[rounded]
            data = data.astype(np.float16).astype(np.float32) if rounded == "F16" else \
                gguf.quants.dequantize(gguf.quants.quantize(data, kind), kind)
        if qtype == "F32" or small:
            w.add_tensor(name, data)
        elif qtype == "F16":
            w.add_tensor(name, data.astype(np.float16))
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def state_pool(config, num_slots: int = 4, device: torch.device | str = "cpu") -> StatePool:
    return StatePool(StateSpec(config.num_linear_layers, config.delta), num_slots, device)


def run_steps(model, steps: list[list[tuple[int, int]]], ids: list[list[int]], block_size: int = 4,
              num_blocks: int = 32) -> list[torch.Tensor]:
    """Logits of each sequence's tokens, over a paged pool and a state pool: step s runs, for every sequence j, its
    tokens steps[s][j] = (start, stop) of ids[j] (an empty range skips it). Sequences own blocks j * 8 .. and slot j."""
    c, dev = model.config, model.device
    pool = KVPool(c, num_blocks, block_size, model.dtype, dev)
    states = state_pool(c, len(ids), dev)
    slots = [states.allocate() for _ in ids]
    tables = [list(range(j * 8, j * 8 + 8)) for j in range(len(ids))]
    out: list[list[torch.Tensor]] = [[] for _ in ids]
    for step in steps:
        run = [(j, a, b) for j, (a, b) in enumerate(step) if b > a]
        toks = [t for j, a, b in run for t in ids[j][a:b]]
        pos = [p for j, a, b in run for p in range(a, b)]
        slot_map = [tables[j][p // block_size] * block_size + p % block_size for j, a, b in run for p in range(a, b)]
        meta = AttentionMetadata.build([b - a for _, a, b in run], [b for _, _, b in run],
                                       [tables[j] for j, _, _ in run], slot_map, dev)
        cu = [0]
        for j, a, b in run:
            cu.append(cu[-1] + b - a)
        st = StepStates.build(states, torch.tensor(cu, device=dev), torch.tensor([slots[j] for j, _, _ in run],
                                                                                 device=dev))
        attn = PagedKVAttention(pool, meta, states=st)
        logits = model.logits(model.forward(torch.tensor(toks, device=dev), torch.tensor(pos, device=dev), attn))
        for (j, a, b), lo, hi in zip(run, cu[:-1], cu[1:]):
            out[j].append(logits[lo:hi])
    return [torch.cat(o) for o in out]
