"""Gemma 4 (dense) against transformers' modeling_gemma4 on tiny random float32 models, from safetensors and from a
GGUF written here with llama.cpp's names and keys: prefill and decode logits through the paged KV pool, KV-shared
layers keeping no K/V, and the engine's greedy output batched == alone and prefix-cache hit == miss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention, kv_bytes_per_token, pool_blocks_for_budget
from edgeserve.kernels.dispatch import AttentionMetadata
from edgeserve.loaders.hf_folder import HFFolder
from edgeserve.models.config import config_from_hf
from edgeserve.models.decoders import decoder_class
from edgeserve.models.archs.gemma4.model import Gemma4Model

from support.gguf_writer import write_model_gguf
from support.model_sources import gguf_source, saved_source

transformers = pytest.importorskip("transformers")

VOCAB = 96
PROMPT = [1, 5, 17, 33, 2, 60, 7, 81, 12, 44]  # 10 prompt tokens (past the window of 5), then decodes
DECODES = 4
SLIDING, FULL = "sliding_attention", "full_attention"


def hf_config(shape: str, **overrides):
    """E2B-shaped: per-layer embeddings, the last 3 of 7 layers KV-shared, a double-wide MLP there, proportional
    RoPE on 32-wide global heads next to 16-wide sliding ones. 31B-shaped: no E-model extras, global layers with
    K = V and their own K/V head count. 26B-A4B-shaped: the 31B one with 8 routed experts (2 a token) beside
    each layer's dense MLP. `overrides`: config fields to change."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, head_dim=16,
                  global_head_dim=32, sliding_window=5, max_position_embeddings=64, rms_norm_eps=1e-6,
                  final_logit_softcapping=5.0, tie_word_embeddings=True)
    if shape == "e2b":
        e2b = dict(num_hidden_layers=7, num_key_value_heads=1,
                   layer_types=[SLIDING, SLIDING, FULL, SLIDING, FULL, SLIDING, FULL],
                   hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=3,
                   use_double_wide_mlp=True, attention_k_eq_v=False)
        return transformers.Gemma4TextConfig(**{**common, **e2b, **overrides})
    moe = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32) \
        if shape == "26b-a4b" else {}
    dense = dict(num_hidden_layers=4, num_key_value_heads=2, layer_types=[SLIDING, FULL, SLIDING, FULL],
                 hidden_size_per_layer_input=0, num_kv_shared_layers=0, attention_k_eq_v=True,
                 num_global_key_value_heads=1)
    return transformers.Gemma4TextConfig(**{**common, **dense, **moe, **overrides})


def hf_model(shape: str, spread: float = 0.15, **overrides):
    """transformers' model of `hf_config(shape, **overrides)` with random weights of std `spread` (norm weights
    1 +- 2 spread)."""
    torch.manual_seed(0)
    cfg = hf_config(shape, **overrides)
    cfg._attn_implementation = "eager"
    model = transformers.Gemma4ForCausalLM(cfg).eval()
    with torch.no_grad():  # far from the init, so attention, soft-capping and the layer scales all bite
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("scale"):
                p.copy_(1.0 + 2 * spread * torch.randn_like(p))
            else:
                p.normal_(0.0, spread)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    return model


def write_gguf(model, path: Path, q8_0: bool = False) -> Path:
    """The model as llama.cpp's converter writes a Gemma 4 GGUF (its keys, names, norms as stored, proportional RoPE
    as a `rope_freqs` tensor of divisors). `q8_0`: matrices whose rows are whole Q8_0 blocks are stored so."""
    return write_model_gguf(model, path, qtype="Q8_0" if q8_0 else "F32")


def ours(model, tmp_path: Path, source: str, dtype: torch.dtype = torch.float32) -> Gemma4Model:
    if source == "safetensors":
        config, weights = saved_source(model, tmp_path / "hf")
    else:
        config, weights = gguf_source(write_gguf(model, tmp_path / "m.gguf", q8_0=source == "gguf-q8_0"))
    assert config.architecture == "gemma4"
    cls = decoder_class(config)
    assert cls is Gemma4Model
    return cls.from_weights(config, weights, dtype=dtype)


def paged_logits(model: Gemma4Model, block_size: int = 4) -> torch.Tensor:
    """Prefill PROMPT in two chunks, then single-token decode steps, through a paged pool."""
    ids = PROMPT + list(range(40, 40 + DECODES))
    pool = KVPool(model.config, 8, block_size, model.dtype)  # no window pool: sliding layers apart by shape
    table = list(range(8))
    steps = [(0, 6), (6, len(PROMPT))] + [(p, p + 1) for p in range(len(PROMPT), len(ids))]
    out = []
    for a, b in steps:
        meta = AttentionMetadata.build([b - a], [b], [table], list(range(a, b)))
        hidden = model.forward(torch.tensor(ids[a:b]), torch.arange(a, b), PagedKVAttention(pool, meta))
        out.append(model.logits(hidden))
    return torch.cat(out)


def reference(model) -> torch.Tensor:
    ids = PROMPT + list(range(40, 40 + DECODES))
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
@pytest.mark.parametrize("shape", ["e2b", "31b", "26b-a4b"])
def test_logits_match_transformers(shape: str, source: str, tmp_path: Path) -> None:
    ref_model = hf_model(shape)
    ref = reference(ref_model)
    model = ours(ref_model, tmp_path, source)
    c = model.config
    assert c.global_head_dim == 32 and c.head_dim == 16 and c.final_softcap == 5.0
    if shape == "e2b":
        assert c.per_layer_input_size == 8 and c.kv_shared_layers == 3 and c.layer_intermediate[-1] == 192
    else:
        assert c.global_k_eq_v and c.global_kv_heads == 1 and c.num_kv_heads == 2
        assert c.is_moe == (shape == "26b-a4b") and (not c.is_moe or (c.num_experts, c.experts_per_token) == (8, 2))
    got = paged_logits(model)
    assert got.shape == ref.shape
    diff = (got - ref).abs().max().item()
    assert diff < 1e-4 * max(1.0, ref.abs().max().item()), f"{shape}/{source}: max diff {diff}"


def test_partial_rope_and_v_norm_matter(tmp_path: Path) -> None:
    """Rotating the whole global head, or weighting V's weightless norm, moves the logits clearly off transformers'."""
    ref_model = hf_model("e2b")
    ref = reference(ref_model)
    model = ours(ref_model, tmp_path, "safetensors")
    full = Gemma4Model(model.config.__class__(**{**model.config.__dict__, "rope_global_partial": 1.0}),
                       model.embed, model.layers, model.norm, model.lm_head, model.dtype, model.device)
    full.ple_table, full.ple_model_proj, full.ple_proj_norm = model.ple_table, model.ple_model_proj, model.ple_proj_norm
    assert (paged_logits(full) - ref).abs().max().item() > 1e-2
    # (a uniform scale would not show: the post-attention RMSNorm undoes it)
    model._v_norm = {d: torch.linspace(0.2, 2.0, d) for d in model._v_norm}
    assert (paged_logits(model) - ref).abs().max().item() > 1e-2


def test_multimodal_checkpoint_loads_its_language_model(tmp_path: Path) -> None:
    """The multimodal `gemma4` config (the text model under `text_config`) with its weights under
    `model.language_model.` gives the text model's logits."""
    from safetensors.torch import load_file, save_file

    ref_model = hf_model("e2b")
    ref = reference(ref_model)
    ref_model.save_pretrained(tmp_path / "hf")
    folder = tmp_path / "mm"
    folder.mkdir()
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    save_file({k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()},
              str(folder / "model.safetensors"))
    text = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": text}
    (folder / "config.json").write_text(json.dumps(cfg))
    config = config_from_hf(cfg)
    assert config.architecture == "gemma4" and config.per_layer_input_size == 8
    model = Gemma4Model.from_weights(config, HFFolder(folder).weights(), dtype=torch.float32)
    assert (paged_logits(model) - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())


def test_q8_0_gguf_at_bfloat16_runs_the_block_weights(tmp_path: Path) -> None:
    """A Q8_0 file at the CPU serving dtype: its matrices stay GGUF blocks (native kernels where built), and the
    logits (the fused native stack's where the kernels build, else the per-op path's) stay close to the float32
    reference."""
    from edgeserve.kernels.cpu import native as cpu_native
    from edgeserve.kernels.cpu.native import BlockWeight

    # Random Gemma 4 blocks are touchy (attention scale 1 over normed q / k): transformers' own bfloat16 copy of
    # these models drifts to cosine 0.997 (31B-shaped) and 0.91 (E2B-shaped) of its float32 logits, so this checks
    # the gentler 31B shape, whose every matrix is whole Q8_0 blocks.
    ref_model = hf_model("31b", spread=0.05)
    ref = reference(ref_model)
    model = ours(ref_model, tmp_path, "gguf-q8_0", dtype=torch.bfloat16)
    if cpu_native.library() is not None:
        assert model.native_decoder() is not None  # the fused native stack runs it (bit for bit the per-op path)
        assert all(isinstance(layer.qkv, BlockWeight) and isinstance(layer.down, BlockWeight)
                   for layer in model.layers)
    got = paged_logits(model).float()
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    assert cos.min().item() > 0.95, cos  # measured 0.974 (Q8_0 and bfloat16 rounding together)


def test_kv_shared_layers_keep_no_kv(tmp_path: Path) -> None:
    c = ours(hf_model("e2b"), tmp_path, "safetensors").config
    assert [c.kv_source(i) for i in range(7)] == [0, 1, 2, 3, 2, 3, 2]
    pool = KVPool(c, 8, 4, torch.float32)
    # owners: sliding 0, 1, 3 (16-wide, 1 head) apart from global 2 (32-wide); nothing for layers 4, 5, 6
    assert pool.k.shape == (1, 8, 4, 1, 32) and pool.window_k.shape == (3, 8, 4, 1, 16)
    assert pool.layer_slot[4] == pool.layer_slot[6] == pool.layer_slot[2] and pool.layer_slot[5] == pool.layer_slot[3]
    assert pool.nbytes == 2 * 8 * 4 * (32 + 3 * 16) * 4
    assert kv_bytes_per_token(c, torch.float32) == 2 * (32 + 3 * 16) * 4
    main, window = pool_blocks_for_budget(2**20, c, torch.float32, 4, 2, 16)
    with_window = KVPool(c, main, 4, torch.float32, window_blocks=window)
    assert with_window.window_k.shape[0] == 3 and with_window.k.shape[0] == 1
    assert with_window.nbytes <= 2**20


@pytest.fixture(scope="module")
def e2b_lm(tmp_path_factory):
    """The E2B-shaped model as a LoadedModel with a byte-level tokenizer (for the engine)."""
    from edgeserve.models.dummy import dummy_chat_template, dummy_tokenizer
    from edgeserve.models.load import LoadedModel

    tmp = tmp_path_factory.mktemp("g4")
    model = ours(hf_model("e2b"), tmp, "gguf")
    return LoadedModel("gemma4-tiny", None, model.config, model, dummy_tokenizer(VOCAB), dummy_chat_template(), 0.0)


def test_engine_batched_equals_alone(e2b_lm) -> None:
    from edgeserve.llm import LLM
    from edgeserve.sampling_params import SamplingParams

    prompts = [[3, 9, 27, 81 % VOCAB, 14, 50, 6, 70, 11, 2, 90, 33], [4, 8, 15, 16, 23, 42], [7] * 9]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM.from_model(e2b_lm, kv_cache_gb=0.01, block_size=4)
    pool = llm.engine.pool
    # the sliding layers' own window pool, 3 sliding and 1 global owner layer: nothing for the 3 shared ones
    assert pool.window == 5 and pool.window_k.shape[0] == 3 and pool.k.shape[0] == 1
    batched = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    alone = [LLM.from_model(e2b_lm, kv_cache_gb=0.01, block_size=4).generate([p], params)[0].outputs[0].token_ids
             for p in prompts]
    assert batched == alone
    assert len(set(map(tuple, batched))) > 1


def test_engine_prefix_cache_hit_equals_miss(e2b_lm) -> None:
    from edgeserve.llm import LLM
    from edgeserve.sampling_params import SamplingParams

    first = list(range(10, 40))
    second = first + [5, 6, 7, 8, 9]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    cached = LLM.from_model(e2b_lm, kv_cache_gb=0.01, block_size=4, enable_prefix_caching=True)
    cached.generate([first], params)
    hit = cached.generate([second], params)[0]
    assert hit.num_cached_tokens >= 16
    fresh = LLM.from_model(e2b_lm, kv_cache_gb=0.01, block_size=4, enable_prefix_caching=False).generate([second],
                                                                                                           params)[0]
    assert fresh.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_moe_experts_matter(tmp_path: Path) -> None:
    """The 26B-A4B-shaped model without its per-expert scales is clearly off transformers' (the routed experts,
    scaled each, are in the logits)."""
    ref_model = hf_model("26b-a4b")
    ref = reference(ref_model)
    model = ours(ref_model, tmp_path, "safetensors")
    for layer in model.layers:
        layer.per_expert_scale = torch.ones_like(layer.per_expert_scale)
    assert (paged_logits(model) - ref).abs().max().item() > 1e-2


def test_gguf_gemma4_tokenizer_uses_the_file_merges() -> None:
    """llama.cpp's 'gemma4' tokenizer model: raw UTF-8 pieces with `▁` for spaces, no dummy prefix, merged by the
    file's ranked merges (not by scores, which here would merge nothing)."""
    from edgeserve.loaders.tokenizer import tokenizer_from_gguf

    tokens = ["<pad>", "<eos>", "<bos>", "h", "e", "l", "o", "▁", "w", "r", "d", "he", "ll", "hell", "hello", "▁w",
              "or", "▁wor", "▁worl", "▁world"]
    merges = ["h e", "l l", "he ll", "hell o", "▁ w", "o r", "▁w or", "▁wor l", "▁worl d"]
    tok = tokenizer_from_gguf({
        "tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.scores": [0.0] * len(tokens), "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (len(tokens) - 3),
        "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.ggml.add_bos_token": True})
    ids = tok.encode("hello world")
    assert ids == [2, tokens.index("hello"), tokens.index("▁world")]
    assert tok.decode(ids[1:]) == "hello world"


# A Gemma-4-style template (turn markers, `<|think|>` switched by enable_thinking, tools declared in the system
# turn, calls written back as `<|tool_call>call:NAME{...}<tool_call|>`): the plumbing, not Google's exact text.
GEMMA4_STYLE_TEMPLATE = (
    "{{ bos_token }}{% if enable_thinking or tools %}<|turn>system\n{% if enable_thinking %}<|think|>{% endif %}"
    "{% for t in tools or [] %}<|tool>declaration:{{ t.function.name }}<tool|>{% endfor %}<turn|>\n{% endif %}"
    "{% for m in messages %}<|turn>{{ 'model' if m.role == 'assistant' else m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<|tool_call>call:{{ c.function.name }}{}<tool_call|>{% endfor %}<turn|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")


@pytest.mark.parametrize("think", [True, False, None])
def test_thinking_switch_and_thought_channel(think) -> None:
    from edgeserve.engine.outputs import RequestOutput
    from edgeserve.loaders.chat_template import ChatTemplate
    from edgeserve.server.chat_setup import chat_setup
    from edgeserve.server.request import GenerationRequest

    req = GenerationRequest(model="m", messages=[{"role": "user", "content": "Hi"}],
                            template_kwargs={} if think is None else {"enable_thinking": think})
    req.think = think
    setup = chat_setup(req, ChatTemplate(GEMMA4_STYLE_TEMPLATE, "<bos>"))
    assert ("<|think|>" in setup.prompt) == bool(think)
    assert setup.prompt.endswith("<|turn>model\n")
    parser = setup.parser()  # reasoning off too: a thought the model writes anyway is reasoning, never content
    reply = "<|channel>thought\nThe user greets.<channel|>Hello!"
    out = RequestOutput(request_id="r", text="", token_ids=[], logprobs=None, finish_reason=None)
    out.text = reply[:12]
    setup.split(parser, out)
    first = (out.reasoning, out.text)
    out.text, out.finish_reason = reply[12:], "stop"
    setup.split(parser, out)
    assert first[0] + out.reasoning == "The user greets." and first[1] + out.text == "Hello!"


def test_tool_calls_in_gemma4_format_are_parsed() -> None:
    from edgeserve.engine.outputs import RequestOutput
    from edgeserve.loaders.chat_template import ChatTemplate
    from edgeserve.server.chat_setup import chat_setup
    from edgeserve.server.request import GenerationRequest

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    req = GenerationRequest(model="m", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
                            tool_choice="auto")
    setup = chat_setup(req, ChatTemplate(GEMMA4_STYLE_TEMPLATE, "<bos>"))
    assert "<|tool>declaration:get_weather<tool|>" in setup.prompt and setup.tools.format.name == "gemma4"
    out = RequestOutput(request_id="r", text='Let me check.<|tool_call>call:get_weather{city:<|"|>Paris, FR<|"|>,'
                        'days:2}<tool_call|>', token_ids=[], logprobs=None, finish_reason="stop")
    setup.split(setup.parser(), out)
    assert out.text == "Let me check." and out.finish_reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather",
                                                                             {"city": "Paris, FR", "days": 2})]


def test_kv_offload_is_refused_clearly(e2b_lm) -> None:
    """The offload tiers copy one pool of every layer, which a model with sliding layers of another K/V head shape
    does not have: refused by name rather than run with the sliding layers' K/V left out."""
    from edgeserve.llm import LLM

    with pytest.raises(ValueError, match="kv-offload"):
        LLM.from_model(e2b_lm, kv_cache_gb=0.01, block_size=4, kv_offload="cpu", cpu_kv_gb=0.01)
