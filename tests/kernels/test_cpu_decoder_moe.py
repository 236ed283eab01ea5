"""Qwen3 MoE and gpt-oss in the fused native stack (kernels/cpu/src/layer.c with moe_layer.c's feed-forward at
layer_t.moe, planned by kernels.cpu.decoder_moe): on a tiny qwen3moe GGUF (Q8_0 matrices, Q4_0 / Q8_0 experts,
GGUF or repacked layout) at bfloat16 the whole stack runs in one native call per step and gives the per-op path's
hidden states and K/V pool bit for bit through prompt chunks and decodes; a row's result does not depend on its
batch; the engine's greedy tokens are the same fused and per-op, chunked and whole. gpt-oss (MXFP4 experts with
biases and the clamped SwiGLU, attention sinks, o_proj biases, a sliding window of 4 on every other layer, in the
window pool or not, bf16 and q8_0 pools) the same way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.cpu.decoder import NativeDecoder
from edgeserve.kernels.formats.experts import BlockExperts
from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.loaders.gguf_weights import GGUFWeights
from edgeserve.models.config import config_from_gguf
from edgeserve.models.load import LoadedModel
from edgeserve.models.archs.qwen3moe.model import MoEModel

pytest.importorskip("transformers")
from test_cpu_decoder import STEPS, _native_on, run_steps  # noqa: E402,F401  (the fixture keeps the kernels on)
import test_gpt_oss  # noqa: E402
from test_gpt_oss import hf_gpt_oss, load_ours  # noqa: E402
from test_qwen3_moe import VOCAB, hf_moe, write_moe_gguf  # noqa: E402
from test_window_blocks import engine, generate  # noqa: E402
from support.fused_runs import fused_and_per_op, stub_loaded  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no native CPU kernels here")


def qwen3moe(path: Path, expert_qtype: str = "Q4_0", repack: str = "0", monkeypatch=None) -> MoEModel:
    """The tiny Qwen3 MoE as a GGUF (Q8_0 matrices, `expert_qtype` experts), loaded at the CPU serving dtype with
    its experts in the file's layout or (`repack` "1") the kernels' faster one."""
    monkeypatch.setenv("EDGESERVE_MOE_REPACK", repack)
    g = GGUFFile(write_moe_gguf(hf_moe(), path, expert_qtype=expert_qtype, matrix_qtype="Q8_0"))
    config = config_from_gguf(g.metadata, set(g.tensor_names()))
    model = MoEModel.from_weights(config, GGUFWeights(g, config.num_heads, config.num_kv_heads), dtype=torch.bfloat16)
    assert all(isinstance(layer.moe.gate_up, BlockExperts) for layer in model.layers)
    return model


@pytest.mark.parametrize("expert_qtype,repack", [("Q4_0", "0"), ("Q8_0", "1")])
def test_moe_fused_stack_equals_the_per_op_path(tmp_path, monkeypatch, expert_qtype, repack):
    model = qwen3moe(tmp_path / "m.gguf", expert_qtype, repack, monkeypatch)
    plan = model.native_decoder()
    assert isinstance(plan, NativeDecoder) and len(plan.moe) == model.config.num_layers
    assert all(plan.layers[i].moe == layer.moe.native().address() for i, layer in enumerate(model.layers))
    fused, fused_pool = run_steps(model, True, STEPS)  # prompt chunks of up to 23 rows beside decodes
    per_op, per_op_pool = run_steps(model, False, STEPS)
    for step, (a, b) in enumerate(zip(fused, per_op)):
        assert a.dtype == b.dtype == model.dtype
        assert torch.equal(a, b), f"step {step}: max diff {(a.float() - b.float()).abs().max().item()}"
        assert torch.equal(model.logits(a), model.logits(b))
    assert torch.equal(fused_pool.k, per_op_pool.k) and torch.equal(fused_pool.v, per_op_pool.v)
    # the routing matters: with the top-1 expert alone, the output moves
    for layer in model.layers:
        layer.moe.native().struct.k = 1
    try:
        changed, _ = run_steps(model, True, STEPS[:1])
    finally:
        for layer in model.layers:
            layer.moe.native().struct.k = model.config.experts_per_token
    assert not torch.equal(changed[0], fused[0])


def test_moe_fused_stack_rows_do_not_depend_on_their_batch(tmp_path, monkeypatch):
    model = qwen3moe(tmp_path / "m.gguf", monkeypatch=monkeypatch)
    together, _ = run_steps(model, True, [[(0, 9), (1, 30)], [(0, 1), (1, 1)]])
    alone, _ = run_steps(model, True, [[(1, 11), (1, 19)], [(1, 1)]])  # and its prompt in other chunks
    assert torch.equal(together[1][1], alone[1][0])


PROMPTS = [(13, 5, 37), (5, 11, 13)]  # (step, start, length) of two prompts of tokens; the first in 3 chunks


def _loaded(model: MoEModel, tmp_path: Path) -> LoadedModel:
    return stub_loaded(model, "tiny-qwen3moe", tmp_path)


def test_moe_engine_tokens_are_the_same_fused_and_per_op_chunked_and_whole(tmp_path, monkeypatch):
    model = qwen3moe(tmp_path / "m.gguf", monkeypatch=monkeypatch)
    lm = _loaded(model, tmp_path)
    prompts = [[(a * i + b) % VOCAB for i in range(n)] for a, b, n in PROMPTS]
    outputs = fused_and_per_op(model, lambda: generate(engine(lm, False, monkeypatch, enable_prefix_caching=False),
                                                       prompts, 12))
    assert len(set(outputs[0][0])) > 3  # not a degenerate repetition
    model._native = False
    whole = generate(engine(lm, False, monkeypatch, enable_prefix_caching=False, max_num_batched_tokens=64),
                     prompts[:1], 12)
    assert isinstance(model._native, NativeDecoder)
    assert whole == outputs[0][:1]  # the default engine above took the 37-token prompt in chunks of 16


def wide_gpt_oss():
    """test_gpt_oss's tiny model with heads 32 wide (a q8_0 KV pool's smallest)."""
    t = test_gpt_oss
    torch.manual_seed(0)
    cfg = t.transformers.GptOssConfig(
        vocab_size=t.VOCAB, hidden_size=t.HIDDEN, intermediate_size=t.FFN, num_hidden_layers=t.LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=t.EXPERTS,
        num_experts_per_tok=t.TOP_K, sliding_window=t.WINDOW, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_parameters=dict(t.YARN), tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    model = t.transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5 if "norm" in name or "router" in name else (1.0 if "sinks" in name else 0.15))
    return model


def gpt_oss(tmp_path: Path, wide: bool = False):
    """The tiny gpt-oss (heads 32 wide when `wide`) as a GGUF with MXFP4 experts and Q8_0 matrices, at the CPU
    serving dtype."""
    if "MXFP4" not in cpu_native.FORMATS:
        pytest.skip("MXFP4 not in this build")
    hf = wide_gpt_oss() if wide else hf_gpt_oss()
    model = load_ours("gguf", hf, tmp_path, torch.bfloat16, expert_qtype="MXFP4", matrix_qtype="Q8_0")
    assert all(isinstance(layer.moe.gate_up, BlockExperts) for layer in model.layers)
    return model


@pytest.mark.parametrize("kv", ["model", "q8_0"])
def test_gpt_oss_fused_stack_equals_the_per_op_path(tmp_path, kv):
    from edgeserve.engine.cache.kv_format import Q8_0

    model = gpt_oss(tmp_path, wide=kv == "q8_0")
    plan = model.native_decoder()
    assert isinstance(plan, NativeDecoder) and plan.windowed and plan.min_window == 4
    assert all(plan.layers[i].attn.sinks and plan.layers[i].attn.o_bias for i in range(model.config.num_layers))
    pool_kind = None if kv == "model" else Q8_0  # q8_0: float32 queries and attention output, the sinks in its kernel
    fused, fused_pool = run_steps(model, True, STEPS, kv=pool_kind)  # up to 42 positions: far past the window
    per_op, per_op_pool = run_steps(model, False, STEPS, kv=pool_kind)
    for step, (a, b) in enumerate(zip(fused, per_op)):
        assert torch.equal(a, b), f"step {step}: max diff {(a.float() - b.float()).abs().max().item()}"
    assert torch.equal(fused_pool.k, per_op_pool.k) and torch.equal(fused_pool.v, per_op_pool.v)
    model.sinks = [s * 0 for s in model.sinks]  # the sinks reach the stack: without them, other states
    try:
        changed, _ = run_steps(model, True, STEPS[:1], kv=pool_kind)
    finally:
        model._native = False
    assert not torch.equal(changed[0], fused[0])


@pytest.mark.parametrize("window_pool", [True, False])
def test_gpt_oss_engine_tokens_are_the_same_fused_and_per_op(tmp_path, monkeypatch, window_pool):
    model = gpt_oss(tmp_path)
    lm = _loaded(model, tmp_path)
    prompts = [[(a * i + b) % VOCAB for i in range(n)] for a, b, n in PROMPTS]
    outputs = fused_and_per_op(model, lambda: generate(engine(lm, window_pool, monkeypatch,
                                                              enable_prefix_caching=False), prompts, 12))
    assert len(set(outputs[0][0])) > 3 or len(set(outputs[0][1])) > 3  # not a degenerate repetition


def _near_tie_router(moe, row: torch.Tensor, winner: int, a: int, b: int) -> torch.Tensor:
    """Router rows for `row` (a float32 [hidden] normed input): expert `winner` certain (logit 1), `a` at logit 0
    and `b` at a logit that is positive for `row` and negative for `row` rounded to bfloat16, the rest at -1; so a
    top-2 router picks {winner, b} from the float32 row and {winner, a} from its bf16 rounding."""
    x, rounded = row.double(), row.bfloat16().double()
    r = x - rounded  # the rounding; delta . rounded = -|r|^2 / 2 and delta . x = |r|^2 / 2 - alpha (r . rounded)
    delta = r - (r @ rounded + (r @ r) / 2) / (rounded @ rounded) * rounded
    unit = x / (x @ x)
    router = -unit.repeat(moe.router.shape[0], 1)
    router[winner], router[a], router[b] = unit, 0.0, delta
    router = router.float()
    assert router[b].double() @ x > 0 > router[b].double() @ rounded  # the flip is real at float32 weights
    return router


def test_moe_router_sees_the_float32_row_at_a_near_tie_per_op_and_fused(tmp_path, monkeypatch):
    """A MoE layer's normed input stays float32 in a bfloat16 model (issue 54: bf16 rounding before the router
    flipped experts at near-ties). Layer 0's router is rebuilt around a one-token step's input so that the float32
    row picks experts {2, 1} and its bf16 rounding {2, 0}: the per-op step gives what a router offering only
    expert 1 gives, not what one offering only expert 0 gives, and the fused stack gives the per-op hidden states
    bit for bit."""
    model = qwen3moe(tmp_path / "m.gguf", monkeypatch=monkeypatch)
    moe, seen = model.layers[0].moe, []
    forward = type(moe).forward
    monkeypatch.setattr(type(moe), "forward", lambda self, h: seen.append((self, h)) or forward(self, h))
    step = [[(0, 1)]]
    run_steps(model, False, step)
    h = next(h for layer, h in seen if layer is moe)
    assert h.dtype == torch.float32 and not torch.equal(h, h.bfloat16().float())
    near_tie = _near_tie_router(moe, h[0], winner=2, a=0, b=1)
    moe.router.copy_(near_tie)
    assert moe.route(h)[1][0].tolist() == [2, 1] and moe.route(h.bfloat16())[1][0].tolist() == [2, 0]
    outputs = {}
    for name, drop in (("tie", None), ("only 1", 0), ("only 0", 1)):
        router = near_tie.clone()
        if drop is not None:
            router[drop] = router[3]  # out of the running (logit -1)
        moe.router.copy_(router)
        outputs[name] = run_steps(model, False, step)[0][0].float()
    assert torch.allclose(outputs["tie"], outputs["only 1"], rtol=0, atol=0.02)
    assert (outputs["tie"] - outputs["only 0"]).abs().max() > 0.2
    moe.router.copy_(near_tie)
    fused = run_steps(model, True, step)[0][0].float()
    assert torch.equal(fused, outputs["tie"])
