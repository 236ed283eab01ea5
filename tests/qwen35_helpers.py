"""Tiny random Qwen3.5 hybrids (dense and MoE) from transformers, written as HF folders and as qwen35 / qwen35moe
GGUFs the way llama.cpp's converter writes them (1 + w norms, -exp(A_log), squeezed conv, tiled value heads), and
runners of our model over a paged KV pool and a state pool."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention
from edgeserve.engine.cache.state_pool import StatePool, StateSpec, StepStates
from edgeserve.kernels.dispatch import AttentionMetadata

from support.gguf_tensors import llama_cpp_tensors
from support.gguf_vocab import TOKENS
from support.gguf_writer import matrices, write_model_gguf

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


def write_qwen35_gguf(model, path: Path, qtype: str = "F32", skip: str | None = None,
                      rounded: str | None = None) -> Path:
    """The model as llama.cpp's converter writes a qwen35 / qwen35moe GGUF, with the tests' byte-level tokenizer;
    matrices (not norms, router, conv) stored as `qtype`; `skip`: a tensor name left out (to test the error);
    `rounded`: those matrices stored as F32 after a round trip through that type (the exact values a `qtype` file of
    it holds)."""
    import gguf

    arch = "qwen35moe" if hasattr(model.config, "num_experts") else "qwen35"
    choose = matrices(rounded or "F32")
    tensors = {}
    for name, t in (llama_cpp_tensors(model.state_dict(), model.config, arch).items() if rounded else ()):
        kind = choose(name, t)
        if kind == "F16":
            tensors[name] = t.half().float()
        elif kind != "F32":
            k = gguf.GGMLQuantizationType[kind]
            tensors[name] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(t.numpy(), k), k))
    return write_model_gguf(model, path, arch, qtype=qtype, drop=(skip,) if skip else (), tensors=tensors,
                            pre="qwen2")


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


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> Path:
    """The tiny random Qwen3.5 (hf_qwen35) as a float32 GGUF, written once a module (a test module imports it)."""
    return write_qwen35_gguf(hf_qwen35(), tmp_path_factory.mktemp("qwen35") / "q.gguf")
