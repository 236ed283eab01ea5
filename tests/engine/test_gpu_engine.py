"""The engine on a CUDA GPU (skipped without one): CUDA-graph decode equal to eager, the default model on CUDA
against the CPU path, the KV pool sized from the GPU's memory, and a dummy Llama shape with 4-bit weights.

Run on an H100 on 2026-11-23 (docs/perf-log/2026-11-to-12.md): all pass there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edgeserve.llm import LLM
from edgeserve.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu
TINY = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "tiny-llama.json"
CHATS = ["What is the capital of France?", "Write a Python function that reverses a string.",
         "Tell me a short story about a robot learning to paint.", "List five prime numbers.",
         "Why is the sky blue? Explain it to a child."]


def _chat_ids(lm, text: str) -> list[int]:
    return lm.tokenizer.encode(lm.chat_template.render([{"role": "user", "content": text}]), add_special_tokens=False)


def _greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n))]


@pytest.fixture(scope="module")
def cuda_fp32(default_model_path):
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    return load_model(resolve(str(default_model_path)), dtype="float32", device="cuda")


def test_cuda_graph_decode_equal_to_eager(cuda_fp32):
    """Batches of 1, 3 and 5 sequences (3 and 5 padded to the 4 and 8 buckets): the same greedy tokens with
    CUDA graphs as without (float32, so rounding differences between split layouts cannot flip a choice)."""
    lm = cuda_fp32
    graphed = LLM.from_model(lm, kv_cache_gb=0.2, max_num_seqs=8)
    eager = LLM.from_model(lm, kv_cache_gb=0.2, max_num_seqs=8, enforce_eager=True)
    graphs = graphed.engine.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8] and set(graphs.graphs) == {1, 2, 4, 8}
    assert eager.engine.runner.graphs is None
    for n in (1, 3, 5):
        prompts = [_chat_ids(lm, t) for t in CHATS[:n]]
        assert _greedy(graphed, prompts, 24) == _greedy(eager, prompts, 24)
    assert graphs.replays > 0
    bm = graphed.engine.scheduler.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks


def test_cuda_graph_logits_close_to_eager_bf16(default_model_path):
    """On the default (bf16, 4-bit) path one decode step's logits agree between graph and eager."""
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    lm = load_model(resolve(str(default_model_path)), device="cuda")
    prompts = [_chat_ids(lm, t) for t in CHATS[:3]]
    graphed = LLM.from_model(lm, kv_cache_gb=0.2, max_num_seqs=4)
    eager = LLM.from_model(lm, kv_cache_gb=0.2, max_num_seqs=4, enforce_eager=True)
    a, b = _greedy(graphed, prompts, 16), _greedy(eager, prompts, 16)
    agree = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)) / sum(len(r) for r in a)
    assert agree >= 0.9, (a, b)
    assert all(ra[:4] == rb[:4] for ra, rb in zip(a, b))


def test_default_model_on_cuda_matches_cpu(cuda_fp32, default_model_fp32):
    """End-to-end greedy parity, float32 on both: the first 16 tokens of each prompt are the CPU path's, and the
    prompt logits agree (the CUDA path runs Triton kernels; the CPU path the torch twins)."""
    from edgeserve.models.attention import ContiguousKV

    prompts = [_chat_ids(default_model_fp32, t) for t in CHATS[:3]]
    gpu = _greedy(LLM.from_model(cuda_fp32, kv_cache_gb=0.2), prompts, 16)
    cpu = _greedy(LLM.from_model(default_model_fp32, kv_cache_gb=0.2), prompts, 16)
    assert gpu == cpu
    c = default_model_fp32.config
    ids = prompts[1]
    outs = []
    for lm, dev in ((default_model_fp32, "cpu"), (cuda_fp32, "cuda")):
        kv = ContiguousKV(c.num_layers, len(ids), c.num_kv_heads, c.head_dim, torch.float32, device=dev)
        t = torch.tensor(ids, device=dev)
        outs.append(lm.model.logits(lm.model.forward(t, torch.arange(len(ids), device=dev), kv)).cpu())
    torch.testing.assert_close(outs[1], outs[0], atol=2e-3, rtol=1e-3)


def test_default_bf16_path_on_cuda_agrees_with_cpu(default_model_path, default_model_fp32):
    """The GPU fast path (W4A16 Triton, bf16) picks the float32 CPU path's next token at >= 90% of prompt positions."""
    from edgeserve.kernels.formats.w4a16 import W4A16Weight
    from edgeserve.models.attention import ContiguousKV
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    fast = load_model(resolve(str(default_model_path)), device="auto")
    assert fast.model.device.type == "cuda"
    assert fast.model.dtype == (torch.bfloat16 if torch.cuda.get_device_capability() >= (8, 0) else torch.float16)
    assert isinstance(fast.model.layers[0].qkv, W4A16Weight)  # 4-bit stays 4-bit on the GPU
    ids = _chat_ids(default_model_fp32, CHATS[0])
    c = default_model_fp32.config
    outs = []
    for lm, dev in ((default_model_fp32.model, "cpu"), (fast.model, "cuda")):
        kv = ContiguousKV(c.num_layers, len(ids), c.num_kv_heads, c.head_dim, lm.dtype, device=dev)
        t = torch.tensor(ids, device=dev)
        outs.append(lm.logits(lm.forward(t, torch.arange(len(ids), device=dev), kv)).float().cpu())
    assert (outs[0].argmax(-1) == outs[1].argmax(-1)).float().mean() >= 0.9


def test_kv_pool_sized_from_gpu_memory(default_model_path):
    """Without --kv-cache-gb the pool is what --gpu-memory-fraction leaves after the weights and a warm-up step:
    0.1 more of the device gives the pool 0.1 of the device more."""
    import gc

    from edgeserve.engine.core import EngineCore
    from edgeserve.engine.config import EngineConfig
    from edgeserve.engine.cache.kv_cache import kv_bytes_per_token
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    lm = load_model(resolve(str(default_model_path)), device="cuda")
    _, total = torch.cuda.mem_get_info()

    def pool_bytes(fraction: float) -> tuple[int, int]:
        # seats x context far beyond the device, so the cap on blocks (every seat at full context) never binds
        core = EngineCore(lm, EngineConfig(gpu_memory_fraction=fraction, max_num_seqs=1024, max_model_len=8192,
                                           enforce_eager=True))
        nbytes = core.pool.nbytes
        cap = kv_bytes_per_token(lm.config, lm.model.dtype) * core.max_model_len * 1024
        del core
        gc.collect()
        torch.cuda.empty_cache()
        return nbytes, cap

    small, cap = pool_bytes(0.2)
    large, _ = pool_bytes(0.3)
    assert 0 < small < 0.2 * total and large < 0.3 * total < cap
    assert abs((large - small) - 0.1 * total) < 0.01 * total, (small, large, total)


def test_dummy_int4_llama_shape_generates(tmp_path):
    """A dummy 4-bit model (weights drawn on the GPU, packed W4A16) generates with graphs on."""
    import json

    from edgeserve.kernels.formats.w4a16 import W4A16Weight

    cfg = json.loads(TINY.read_text())
    cfg["quantization_config"] = {"bits": 4, "group_size": 32}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path), device="cuda", load_format="dummy", kv_cache_gb=0.05, max_num_seqs=4)
    assert isinstance(llm.lm.model.layers[0].gate_up, W4A16Weight)
    out = _greedy(llm, [[1, 2, 3], [4, 5, 6, 7]], 8)
    assert [len(o) for o in out] == [8, 8]
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.replays > 0
