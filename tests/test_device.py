"""Device/dtype resolution, GPU KV sizing arithmetic, `--load-format dummy`, the CUDA-graph bookkeeping (bucketing,
padding, static buffers, scratch block) run eagerly on CPU, and the fused forward path against the unfused one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from edgeserve.device import DeviceError, auto_dtype, gpu_kv_budget, resolve_device, resolve_dtype
from edgeserve.engine.runner.cuda_graphs import DecodeGraphs, bucket_for, graph_batch_sizes
from edgeserve.llm import LLM
from edgeserve.models.config import config_from_hf
from edgeserve.models.dummy import DummyWeights, int4_group_size, weight_bytes
from edgeserve.models.load import load_model
from edgeserve.registry import resolve
from edgeserve.sampling_params import SamplingParams

CONFIGS = Path(__file__).resolve().parent.parent / "benchmarks" / "configs"
TINY = CONFIGS / "tiny-llama.json"
GIB = 2**30


# --- device and dtype -------------------------------------------------------------------------------------

def test_auto_device_and_dtype_here():
    dev = resolve_device("auto")
    assert dev.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32


def test_auto_dtype_by_capability():
    cuda = torch.device("cuda", 0)
    assert auto_dtype(cuda, (7, 5)) == torch.float16
    assert auto_dtype(cuda, (8, 0)) == torch.bfloat16
    assert auto_dtype(cuda, (9, 0)) == torch.bfloat16


@pytest.mark.parametrize("spec, words", [("mps", "not supported"), ("gpu0", "not a device name"),
                                         ("cuda:x", "not a device name"), ("cpu:1", "only one cpu")])
def test_bad_devices_are_one_line_errors(spec, words):
    with pytest.raises(DeviceError, match=words) as e:
        resolve_device(spec)
    assert "\n" not in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_refused():
    with pytest.raises(DeviceError, match="no CUDA device"):
        resolve_device("cuda")


def test_bad_dtype():
    with pytest.raises(DeviceError):
        resolve_dtype("float8", torch.device("cpu"))


def test_gpu_kv_budget_arithmetic():
    # 80 GiB device, 0.9 of it: 72 GiB. Outside torch: 80 - 60 free - 19 reserved = 1 GiB (CUDA context).
    # Warm-up peak (16 GiB weights + 2 GiB activations) = 18 GiB. Pool: 72 - 1 - 18 = 53 GiB.
    assert gpu_kv_budget(80 * GIB, 60 * GIB, 19 * GIB, 18 * GIB, 0.9) == 53 * GIB
    # another process holding 10 GiB shrinks the pool by as much
    assert gpu_kv_budget(80 * GIB, 50 * GIB, 19 * GIB, 18 * GIB, 0.9) == 43 * GIB
    # nothing left: zero, not negative
    assert gpu_kv_budget(24 * GIB, 2 * GIB, 20 * GIB, 21 * GIB, 0.9) == 0
    with pytest.raises(ValueError):
        gpu_kv_budget(GIB, GIB, 0, 0, 1.5)


def test_engine_config_checks_gpu_memory_fraction():
    from edgeserve.engine.config import EngineConfig

    assert EngineConfig(gpu_memory_fraction=0.5).gpu_memory_fraction == 0.5
    for bad in (0, 1.2, -0.1):
        with pytest.raises(ValueError, match="gpu_memory_fraction"):
            EngineConfig(gpu_memory_fraction=bad)


# --- dummy weights ----------------------------------------------------------------------------------------

def test_llama3_8b_config_and_byte_count():
    cfg = json.loads((CONFIGS / "llama-3-8b.json").read_text())
    c = config_from_hf(cfg)
    assert (c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.vocab_size) == \
        (4096, 14336, 32, 32, 8, 128256)
    assert (c.rope_theta, c.max_position_embeddings, c.rms_norm_eps, c.tie_word_embeddings) == (500000.0, 8192, 1e-5, False)
    # the shapes only (nothing of 16 GB is allocated): Llama-3-8B has 8,030,261,248 parameters
    shapes = DummyWeights(c).shapes
    assert sum(torch.Size(s).numel() for s in shapes.values()) == 8_030_261_248
    norms = 65 * 4096  # 2 per layer + the final one, kept float32
    assert weight_bytes(c, torch.bfloat16) == 2 * 8_030_261_248 + 2 * norms
    # int4, group 128: half a byte per layer-matrix weight + a bf16 scale and offset per 128 of them
    matrix = 32 * 218_103_808
    int4 = json.loads((CONFIGS / "llama-3-8b-int4.json").read_text())
    assert int4_group_size(int4) == 128 and int4_group_size(cfg) is None
    expected = matrix // 2 + 2 * 2 * matrix // 128 + 2 * 2 * 128256 * 4096 + 4 * norms
    assert weight_bytes(c, torch.bfloat16, 128) == expected
    assert 5.5e9 < expected < 6.0e9  # about 5.8 GB: the bf16 embedding and head are 2.1 GB of it


def test_dummy_int4_blocks_are_never_dense(tmp_path):
    cfg = json.loads(TINY.read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32}
    c = config_from_hf(cfg)
    w = DummyWeights(c, int4_group=int4_group_size(cfg))
    from edgeserve.kernels.formats.quant_linear import Q4Blocks

    blocks = w.get("model.layers.0.mlp.down_proj.weight", keep_int4=True)
    assert isinstance(blocks, Q4Blocks) and blocks.group_size == 32 and blocks.q.dtype == torch.uint8
    dense = blocks.dequantize()
    assert dense.abs().mean() < 0.05 and torch.isfinite(dense).all()
    # a 4-bit dummy model loads and generates (4-bit weights stay packed on CPU in bf16)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    lm = load_model(resolve(str(tmp_path)), load_format="dummy")
    assert type(lm.model.layers[0].gate_up).__name__ in ("Int4Weight", "W4A16Weight")
    out = LLM.from_model(lm, kv_cache_gb=0.01).generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_dummy_tiny_model_generates():
    llm = LLM(str(TINY), load_format="dummy", kv_cache_gb=0.01)
    assert llm.lm.name == "tiny-llama" and llm.lm.model.device.type == resolve_device("auto").type
    assert llm.lm.tokenizer.vocab_size == 300
    text = "héllo wörld"
    assert llm.tokenizer.decode(llm.tokenizer.encode(text)) == text
    out = llm.generate(["hello", "a longer prompt here"], SamplingParams(temperature=0, max_tokens=6))
    assert [len(r.outputs[0].token_ids) for r in out] == [6, 6]  # no end-of-turn id: always max_tokens
    assert llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids


def test_one_load_config_carries_every_load_option():
    """LLM and load_model take the options as one LoadConfig (what the CLI and the server pass); its bad values
    are one-line errors before anything loads, and it is not mixed with loose keywords."""
    from edgeserve.errors import EdgeserveError, ModelLoadError
    from edgeserve.models.load_config import LoadConfig

    load = LoadConfig(dtype="float32", device="cpu", load_format="dummy")
    llm = LLM(str(TINY), load=load, kv_cache_gb=0.01)
    assert llm.lm.model.dtype == torch.float32 and llm.lm.model.device.type == "cpu"
    with pytest.raises(EdgeserveError, match="group"):
        load_model(resolve(str(TINY)), LoadConfig(load_format="dummy", quantize="int4", quantize_group_size=3))
    with pytest.raises(ModelLoadError, match="load format 'weird'"):
        load_model(resolve(str(TINY)), LoadConfig(load_format="weird"))
    with pytest.raises(ValueError, match="not both"):
        load_model(resolve(str(TINY)), load, dtype="bfloat16")


def test_config_json_without_dummy_is_refused():
    from edgeserve.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="--load-format dummy"):
        load_model(resolve(str(TINY)))


# --- CUDA-graph bookkeeping -------------------------------------------------------------------------------

def test_graph_batch_sizes_and_buckets():
    assert graph_batch_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert graph_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert graph_batch_sizes(1) == [1]
    sizes = graph_batch_sizes(48)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 9, 17, 33, 48, 49)] == [1, 2, 4, 8, 16, 32, 48, 48, None]


def test_decode_step_is_padded_to_its_bucket_in_the_static_buffers():
    """A step of 3 decodes runs bucket 4: its rows are copied in, the padding row reads the scratch block only."""
    from edgeserve.engine.runner.input_batch import StepInputs
    from edgeserve.engine.cache.kv_cache import KVPool

    lm = load_model(resolve(str(TINY)), dtype="float32", device="cpu", load_format="dummy")
    pool = KVPool(lm.config, 10, 16, torch.float32, scratch_block=True)
    g = DecodeGraphs(lm.model, pool, 4, 48, capture=False)
    g.ids.fill_(77)  # a previous step's values must not survive in the padding rows
    i64 = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    inputs = StepInputs(i64([5, 6, 7]), i64([10, 3, 0]), i64([34, 51, 80]), i32([0, 1, 2, 3]), i32([11, 4, 1]),
                        i32([[2], [3], [5]]), [1, 1, 1], [11, 4, 1])
    assert g.prepare(inputs) == 4
    scratch = pool.scratch_block
    assert g.ids[:4].tolist() == [5, 6, 7, 0] and g.positions[:4].tolist() == [10, 3, 0, 0]
    assert g.slots[:4].tolist() == [34, 51, 80, scratch * 16] and g.seq_lens[:4].tolist() == [11, 4, 1, 1]
    assert g.tables[:4, 0].tolist() == [2, 3, 5, scratch]


def _greedy(llm: LLM, prompts: list[list[int]], n: int = 8) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n))]


def test_static_buffer_decode_path_equals_eager():
    """The graph path with capture disabled (bucketing, padding into static buffers, a scratch block, a fixed
    max_seq_len) gives the greedy tokens of the plain eager path; and the scratch block is the only one it adds."""
    from edgeserve.engine.cache.kv_cache import KVPool

    lm = load_model(resolve(str(TINY)), dtype="float32", device="cpu", load_format="dummy")
    prompts = [[(7 * i + j) % 300 for j in range(3 + 5 * i)] for i in range(5)]
    eager = LLM.from_model(lm, kv_cache_gb=0.01, max_num_seqs=8)
    expected = _greedy(eager, prompts)

    graphed = LLM.from_model(lm, kv_cache_gb=0.01, max_num_seqs=8)
    core = graphed.engine
    core.pool = KVPool(lm.config, core.pool.num_blocks, core.pool.block_size, lm.model.dtype, "cpu", scratch_block=True)
    assert core.pool.scratch_block == core.pool.num_blocks and core.pool.k.shape[1] == core.pool.num_blocks + 1
    core.runner.pool = core.pool
    core.runner.graphs = DecodeGraphs(lm.model, core.pool, 8, core.max_model_len, capture=False)
    assert core.runner.graphs.sizes == [1, 2, 4, 8]
    got = _greedy(graphed, prompts)
    assert got == expected
    assert core.runner.graphs.eager_runs >= 7  # the decode steps (5 sequences padded to 8) took the static path
    # the padding rows wrote only into the scratch block: every real block is where the eager engine left it
    assert core.pool.k[:, core.pool.scratch_block].abs().sum() > 0


def test_fused_forward_matches_unfused_in_triton_interpreter():
    """LlamaModel.forward's fused kernels (add_rms_norm, rope_write_kv through the paged pool) in Triton's
    interpreter give the torch path's hidden states."""
    from kernel_utils import kernel_device

    from edgeserve.kernels import dispatch

    kernel_device("cpu")  # CPU tensors through Triton: only in its interpreter (a GPU process compiles instead)
    from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention

    lm = load_model(resolve(str(TINY)), dtype="float32", device="cpu", load_format="dummy")
    c = lm.config
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6][i] for i in range(8)])
    outs = []
    for name in ("torch", "triton"):
        pool = KVPool(c, 4, 4, torch.float32)
        meta = dispatch.AttentionMetadata.build([5, 3], [5, 3], [[0, 1], [2]], [0, 1, 2, 3, 4, 8, 9, 10])
        with dispatch.force_backend(name):
            outs.append((lm.model.forward(ids, torch.tensor([0, 1, 2, 3, 4, 0, 1, 2]), PagedKVAttention(pool, meta)),
                         pool.k.clone()))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[1][1], outs[0][1], atol=1e-5, rtol=1e-5)


def test_graphs_only_where_triton_runs_on_cuda():
    from edgeserve.engine.runner.cuda_graphs import graphs_supported

    assert not graphs_supported(torch.device("cpu"))
    lm = load_model(resolve(str(TINY)), dtype="float32", device="cpu", load_format="dummy")
    from edgeserve.engine.core import EngineCore
    from edgeserve.engine.config import EngineConfig

    core = EngineCore(lm, EngineConfig(kv_cache_gb=0.01))
    assert core.runner.graphs is None and core.pool.scratch_block is None  # CPU: eager, no scratch block


def test_can_run_only_decode_steps_that_fit():
    from edgeserve.engine.cache.kv_cache import KVPool

    lm = load_model(resolve(str(TINY)), dtype="float32", device="cpu", load_format="dummy")
    pool = KVPool(lm.config, 8, 16, torch.float32, scratch_block=True)
    g = DecodeGraphs(lm.model, pool, 4, 64, capture=False)
    assert g.max_blocks == 4
    assert g.can_run([1, 1, 1]) and g.can_run([1] * 4)
    assert not g.can_run([]) and not g.can_run([1] * 5) and not g.can_run([1, 2])
    assert not g.can_run([1], 5)
