"""edgeserve beside llama.cpp's llama-server on the same random-weight GGUFs of real shapes (issue 54), with
transformers' float32 run on the same weights as the judge.

Each case is a transformers checkpoint with a real model's dimensions (taken from edgeserve/bench's writers:
SHAPES, HYBRID_SHAPES, GEMMA4_SHAPES) and fewer layers (the real layer-kind rhythm kept), the converter-parity
case's structure (tests/converter_cases.py) and random weights scaled to the width (logits of a few units),
converted by llama.cpp's own convert_hf_to_gguf.py to f32 (and bf16 / q8_0), or made Q4_K_M from the f32 file by
llama.cpp's llama-quantize (`--keep DIR` keeps the files and reuses them). For each file and each of 8 fixed token-id prompts, the first generated position's
log-probabilities:
- llama-server: /completion with the prompt as token ids, n_predict 2 (the first position read), n_probs 5 (the top 5 of the raw logits'
  softmax, before sampling); its defaults otherwise (f16 KV cache, flash attention auto);
- edgeserve: the server's compute in process (load_model at dtype auto, the default KV format, the prompt in two
  chunks over the paged pool: what `edgeserve serve` runs for the same ids);
- reference: transformers float32 with every weight replaced by the file's dequantized value (tests/dequantized_reference.py's
  substitution), so quantization is not counted, only the engines' compute.
Reported per file: top-1 agreement of the two engines, their top-5 overlap and mean |logprob diff| over
llama-server's top 5; then for each engine its top-1 agreement with the reference and mean |logprob diff| from it
over the same tokens; and the same two for edgeserve with `--kv-cache-dtype bf16` (the CPU default before f16).

    .venv/bin/python benchmarks/quality/beside_llama_server.py [--cases qwen3-0.6b,gpt-oss-20b]
        [--outtypes q8_0,q4_k_m] [--llama-server PATH] [--keep DIR]
"""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from converter_cases import BY_NAME, FULL, LINEAR, SLIDING  # noqa: E402
from converter_parity import (build_checkpoint, convert, load_ours, our_logits, reference_logits,  # noqa: E402
                              spm_tokenizer_folder, spread, tokenizer_folder)
from dequantized_reference import dequantized_reference  # noqa: E402
from test_gpt_oss import write_mxfp4_checkpoint  # noqa: E402

from edgeserve.bench.random_gemma4_gguf import GEMMA4_SHAPES  # noqa: E402
from edgeserve.bench.servers import (ServerError, beside_llama_server_parser, llama_server_binary,  # noqa: E402
                                     work_folder)
from edgeserve.bench.random_gguf import SHAPES  # noqa: E402
from edgeserve.bench.random_hybrid_gguf import HYBRID_SHAPES  # noqa: E402
from edgeserve.bench.random_lfm2_gguf import LFM2_SHAPES  # noqa: E402
from edgeserve.bench.random_mamba2_gguf import MAMBA2_SHAPES  # noqa: E402

PROMPTS, PROMPT_LEN, TOP = 8, 24, 5
LOGIT_SCALE = 2.5  # the output matrix's extra scale: logits with a standard deviation of about 3


@dataclass(frozen=True)
class Shape:
    """A real model's dimensions on a converter-parity case: config fields to set, and a note of what was cut."""

    case: str
    fields: dict = field(default_factory=dict)
    note: str = ""
    fix: Callable[[Path], None] | None = None  # applied to each converted file (the f32 one before quantizing)


def _qwen3() -> dict:
    """Qwen3-0.6B's published config.json (not among the writers' shapes)."""
    return dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                intermediate_size=3072, num_hidden_layers=4, tie_word_embeddings=True)


def _qwen35(name: str = "qwen35-0.8b") -> dict:
    s = HYBRID_SHAPES[name]
    return dict(hidden_size=s.hidden, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
                intermediate_size=s.ffn, linear_num_key_heads=s.linear_k_heads, linear_num_value_heads=s.linear_v_heads,
                linear_key_head_dim=s.linear_head_dim, linear_value_head_dim=s.linear_head_dim,
                num_hidden_layers=4, layer_types=[LINEAR, LINEAR, LINEAR, FULL],
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                 "partial_rotary_factor": s.rope_dims / s.head_dim,
                                 "mrope_section": list(s.rope_sections[:3]), "mrope_interleaved": True})


def _qwen3moe() -> dict:
    s = SHAPES["qwen3-30b-a3b"]
    return dict(hidden_size=s.hidden, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
                num_local_experts=16, num_experts_per_tok=s.experts_used, moe_intermediate_size=s.expert_ffn,
                num_hidden_layers=4, tie_word_embeddings=s.tie_embeddings)


def _qwen35moe() -> dict:
    """Qwen3.5-35B-A3B (HYBRID_SHAPES; transformers' Qwen3_5MoeTextConfig defaults are the same model): 4 of its 40
    layers, 16 of its 256 experts (8 per token, as the real router) beside the one shared expert."""
    s = HYBRID_SHAPES["qwen35moe-35b-a3b"]
    fields = {k: v for k, v in _qwen35().items() if k != "intermediate_size"}
    return dict(fields, hidden_size=s.hidden, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                head_dim=s.head_dim, linear_num_key_heads=s.linear_k_heads, linear_num_value_heads=s.linear_v_heads,
                num_experts=16, num_experts_per_tok=s.experts_used, moe_intermediate_size=s.expert_ffn,
                shared_expert_intermediate_size=s.shared_ffn, tie_word_embeddings=s.tie_embeddings)


def _gemma4_26b() -> dict:
    """google/gemma-4-26B-A4B's text_config (30 layers, 5 sliding : 1 global; 16 heads, 8 KV heads of 256 on the
    sliding layers, 2 of 512 on the global ones with K = V; a 2112-wide dense MLP beside 128 experts of 704, 8 per
    token; window 1024; vocabulary 262144, here the borrowed one's): 6 layers, 16 of the experts."""
    layers = [SLIDING] * 5 + [FULL]
    return dict(hidden_size=2816, num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2,
                head_dim=256, global_head_dim=512, attention_k_eq_v=True, intermediate_size=2112,
                num_experts=16, top_k_experts=8, moe_intermediate_size=704, num_hidden_layers=len(layers),
                layer_types=layers, sliding_window=1024, final_logit_softcapping=30.0)


def _gemma4() -> dict:
    s = GEMMA4_SHAPES["gemma4-e2b"]
    layers = [SLIDING, SLIDING, SLIDING, SLIDING, FULL] * 2
    return dict(hidden_size=s.hidden, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                head_dim=s.head_dim, global_head_dim=s.global_head_dim, intermediate_size=s.ffn,
                hidden_size_per_layer_input=s.per_layer, num_hidden_layers=len(layers), layer_types=layers,
                num_kv_shared_layers=5, sliding_window=s.window, final_logit_softcapping=30.0)


def _gpt_oss() -> dict:
    s = SHAPES["gpt-oss-20b"]
    return dict(hidden_size=s.hidden, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                head_dim=s.head_dim, intermediate_size=s.expert_ffn, num_local_experts=8,
                num_experts_per_tok=s.experts_used, num_hidden_layers=2, sliding_window=128)


def _lfm2() -> dict:
    """LFM2.5-1.2B (LFM2_SHAPES: its config.json's block_ff_dim 12288, which the auto-adjust makes the 8192 the
    writer has): its first 6 of 16 layers (conv, conv, attention, conv, conv, attention, the real rhythm)."""
    s = LFM2_SHAPES["lfm2.5-1.2b"]
    layers = ["conv" if i not in s.attention else FULL for i in range(6)]
    return dict(hidden_size=s.hidden, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                intermediate_size=12288, block_multiple_of=256, block_ffn_dim_multiplier=1.0,
                block_auto_adjust_ff_dim=True, conv_L_cache=s.conv_kernel, num_hidden_layers=len(layers),
                layer_types=layers)


def _nemotron_h() -> dict:
    """NVIDIA-Nemotron-Nano-9B-v2's config.json (nemotron_h, dense) as recalled (no writer has the shape): its
    blocks "M-M-M-MM-M-M-M*-..." cut to "M-M*-"."""
    return dict(hidden_size=4480, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                intermediate_size=15680, mamba_num_heads=128, mamba_head_dim=80, ssm_state_size=128, n_groups=8,
                conv_kernel=4, chunk_size=128, layers_block_type=_blocks("M-M*-"), num_hidden_layers=5)


def _nemotron_h_moe() -> dict:
    """Nemotron 3 Nano 30B-A3B's config.json (nemotron_h_moe) as recalled: its blocks "MEMEM*EMEMEM*..." cut to
    "MEM*E", 16 of its 128 experts (6 a token)."""
    return dict(hidden_size=2688, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
                mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4,
                chunk_size=128, n_routed_experts=16, num_experts_per_tok=6, moe_intermediate_size=1856,
                moe_shared_expert_intermediate_size=3712, routed_scaling_factor=2.5,
                layers_block_type=_blocks("MEM*E"), num_hidden_layers=5)


def _nemotron3_nano_4b() -> dict:
    """Nemotron 3 Nano 4B (MAMBA2_SHAPES, dense nemotron_h): its blocks cut to "M-M*-"."""
    s = MAMBA2_SHAPES["nemotron3-nano-4b"]
    return dict(hidden_size=s.hidden, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                head_dim=s.head_dim, intermediate_size=s.ffn, mamba_num_heads=s.ssm_heads,
                mamba_head_dim=s.ssm_head_dim, ssm_state_size=s.ssm_state, n_groups=s.ssm_groups,
                conv_kernel=s.conv_kernel, chunk_size=128, layers_block_type=_blocks("M-M*-"), num_hidden_layers=5)


def _blocks(pattern: str) -> list[str]:
    """transformers' Nemotron-H block types of a `hybrid_override_pattern`."""
    return [{"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}[c] for c in pattern]


def _granite_h(name: str, types: list[str], experts: int = 0) -> dict:
    """A Granite 4 H shape of edgeserve/bench's writer (MAMBA2_SHAPES) on the converter case's layout: its widths,
    heads, KV heads and Mamba-2 dims, the `types` layers, `experts` of its experts; Granite's multipliers are the
    converter case's."""
    s = MAMBA2_SHAPES[name]
    moe = dict(num_local_experts=experts, num_experts_per_tok=s.experts_used, intermediate_size=s.expert_ffn) \
        if experts else dict(num_local_experts=0, num_experts_per_tok=0,  # as released (llama.cpp refuses k of 0)
                             intermediate_size=s.ffn)  # llama.cpp reads the MLP's width from it (feed_forward_length)
    return dict(hidden_size=s.hidden, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                shared_intermediate_size=s.ffn, mamba_n_heads=s.ssm_heads, mamba_d_head=s.ssm_head_dim,
                mamba_d_state=s.ssm_state, mamba_n_groups=s.ssm_groups, mamba_d_conv=s.conv_kernel,
                mamba_chunk_size=128, layer_types=types, num_hidden_layers=len(types), **moe)


def granite_kv_heads(path: Path) -> None:
    """Write the KV heads of a converted granitehybrid file's attention layers (those with `attn_k`) into its
    per-layer `attention.head_count_kv`, in place: llama.cpp's converter under transformers 5 writes 0 on every
    layer, which llama-server refuses (it takes a layer of 0 KV heads for Mamba-2) and from which no reader can
    know the GQA. The heads are the K projection's rows over the head size."""
    import gguf

    r = gguf.GGUFReader(str(path), "r+")
    kv = r.fields.get("granitehybrid.attention.head_count_kv")
    if kv is None or len(kv.data) < 2:
        raise ValueError(f"{path} has no per-layer granitehybrid.attention.head_count_kv")
    width = int(r.fields["granitehybrid.embedding_length"].contents())
    heads = int(r.fields["granitehybrid.attention.head_count"].contents())
    rows = {t.name: int(t.shape[1]) for t in r.tensors if t.name.endswith("attn_k.weight")}  # ne: columns first
    for i, part in enumerate(kv.data):
        k = rows.get(f"blk.{i}.attn_k.weight")
        if k:
            kv.parts[part][0] = k // (width // heads)
    r.data.flush()


def nemotron_layer_counts(path: Path) -> None:
    """Write a converted dense Nemotron-H file's per-layer MLP widths (the blocks with `ffn_up`) into its
    `feed_forward_length`, and its expert counts to 0, in place: llama.cpp's converter under transformers 5 (whose
    AutoConfig fills in MoE defaults) writes such a checkpoint as `nemotron_h_moe` with 0 widths on every block and 8
    experts, so llama-server takes the MLP blocks for Mamba-2 ones (`blk.1.ssm_in.weight` not found)."""
    import gguf

    r = gguf.GGUFReader(str(path), "r+")
    arch = r.fields["general.architecture"].contents()
    names = {t.name: t for t in r.tensors}
    if any("_exps." in n for n in names):
        return  # an MoE file: the converter's counts are right
    ff = r.fields[f"{arch}.feed_forward_length"]
    for i, part in enumerate(ff.data):
        up = names.get(f"blk.{i}.ffn_up.weight")
        ff.parts[part][0] = int(up.shape[1]) if up is not None else 0
    for key in ("expert_count", "expert_used_count", "expert_group_count", "expert_group_used_count"):
        field = r.fields.get(f"{arch}.{key}")
        for part in (field.data if field is not None else ()):
            field.parts[part][0] = 0
    r.data.flush()


def _falcon_h1() -> dict:
    """Falcon-H1-0.5B's config.json (falcon-h1) as recalled: 4 of its layers (attention beside Mamba-2 in each);
    the multipliers are the converter case's."""
    return dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=2048,
                mamba_d_ssm=1536, mamba_n_heads=24, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1,
                mamba_chunk_size=128, num_hidden_layers=4)


SHAPED = {
    "qwen3-0.6b": Shape("qwen3", _qwen3(), "4 of 28 layers"),
    "qwen35-0.8b": Shape("qwen35", _qwen35(), "4 of 24 layers (3 DeltaNet + 1 full attention, the real rhythm)"),
    "qwen35-2b": Shape("qwen35", _qwen35("qwen35-2b"), "4 of 24 layers (3 DeltaNet + 1 full attention)"),
    "qwen3-30b-a3b": Shape("qwen3moe", _qwen3moe(), "4 of 48 layers, 16 of 128 experts (8 per token)"),
    "gemma4-e2b": Shape("gemma4-e2b", _gemma4(), "10 of 35 layers (4 sliding : 1 global), the last 5 KV-shared"),
    "qwen35moe-35b-a3b": Shape("qwen35moe-mtp", _qwen35moe(),
                               "4 of 40 layers (3 DeltaNet + 1 full attention), 16 of 256 experts (8 per token) + "
                               "the shared one, converted with its MTP block"),
    "gemma4-26b-a4b": Shape("gemma4-26b-a4b", _gemma4_26b(),
                            "6 of 30 layers (5 sliding : 1 global, K = V), 16 of 128 experts (8 per token) + the "
                            "dense MLP"),
    "gpt-oss-20b": Shape("gpt-oss", _gpt_oss(), "2 of 24 layers, 8 of 32 experts (4 per token), MXFP4 experts"),
    "nemotron-nano-9b-v2": Shape("nemotron_h", _nemotron_h(), "5 of 56 blocks (M-M*-)"),
    "nemotron3-nano-30b-a3b": Shape("nemotron_h_moe", _nemotron_h_moe(),
                                    "5 of 52 blocks (MEM*E), 16 of 128 experts (6 per token)"),
    "granite4-h-micro": Shape("granitehybrid", _granite_h("granite4-h-micro", ["mamba"] * 3 + ["attention"]),
                              "4 of 40 layers (3 Mamba-2, 1 attention), its 8 KV heads written in", granite_kv_heads),
    "granite4-h-tiny": Shape("granitehybrid-moe", _granite_h("granite4-h-tiny", ["mamba"] * 3 + ["attention"], 16),
                             "4 of 40 layers (3 Mamba-2, 1 attention), 16 of 64 experts (6 per token) + the shared "
                             "MLP, its 4 KV heads written in", granite_kv_heads),
    "nemotron3-nano-4b": Shape("nemotron_h", _nemotron3_nano_4b(), "5 of 42 blocks (M-M*-), its MLP widths written in",
                               nemotron_layer_counts),
    "falcon-h1-0.5b": Shape("falcon-h1", _falcon_h1(), "4 of 36 layers"),
    "lfm2.5-1.2b": Shape("lfm2", _lfm2(), "6 of 16 layers (4 short-conv, 2 attention, the real rhythm)"),
}


def shaped_case(name: str):
    """The converter-parity case `name` builds on, with the real dimensions and width-scaled random weights."""
    shape = SHAPED[name]
    base = BY_NAME[shape.case]

    def config(vocab: int):
        cfg = base.config(vocab)  # a text model's config (not a multimodal one's): rebuilt with the real fields
        values = {k: v for k, v in cfg.to_dict().items() if k != "per_layer_config"}  # derived again from these
        if "layer_types" not in shape.fields:
            values.pop("layer_types", None)  # the config's own rhythm for the new layer count
        values.update(shape.fields)
        if "gemma4" in shape.case:
            values["vocab_size_per_layer_input"] = vocab
        real = type(cfg)(**values)
        # the reference's experts one at a time: transformers' batched default gathers an expert matrix per routed
        # token (GBs at these widths; the first Nemotron 3 Nano run was killed for memory)
        real._experts_implementation = "eager"
        return real

    def init(model) -> None:
        (base.init or spread)(model)
        scale = (64 / model.config.get_text_config().hidden_size) ** 0.5  # the cases' weights are drawn for width 64
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.mul_(scale)
            model.get_output_embeddings().weight.mul_(LOGIT_SCALE)

    post = base.post_save
    if post is write_mxfp4_checkpoint:  # MXFP4 scales near the width-scaled weights' size
        post = functools.partial(write_mxfp4_checkpoint, exponents=(117, 120))
    return replace(base, name=name, config=config, init=init, post_save=post)


def make_file(outtype: str, folder: Path, f32: Path, convert_args: tuple[str, ...], quantize: Path) -> Path:
    """The GGUF of `outtype`: the converter's (f32, bf16, q8_0), or llama-quantize's from the f32 file (q4_k_m)."""
    out = f32.with_name(f32.name.replace(".f32.", f".{outtype}."))
    if outtype == "f32" or out.exists():
        return f32 if outtype == "f32" else out
    if outtype in ("bf16", "q8_0"):
        return _whole(out, lambda part: convert(folder, part, *convert_args, outtype=outtype))

    def quantized(part: Path) -> None:
        run = subprocess.run([str(quantize), str(f32), str(part), outtype.upper(), "2"], capture_output=True,
                             text=True)
        if run.returncode:
            raise RuntimeError(f"llama-quantize failed: {(run.stderr or run.stdout).strip()[-2000:]}")

    return _whole(out, quantized)


def _whole(out: Path, write) -> Path:
    """`out` written by `write(part)` under a temporary name, renamed once whole (so `--keep` never reuses a file
    a killed or timed-out run left half written)."""
    part = out.with_name(out.name + ".part")
    write(part)
    part.rename(out)
    return out


def fresh_model(case, model, folder: Path):
    """A copy of the case's float32 model to substitute weights in: a deep copy of `model` where the folder stores
    the weights otherwise (gpt-oss's MXFP4 experts), else (`model` None) read again from the saved folder."""
    if model is not None:
        return copy.deepcopy(model)
    import transformers

    cls = getattr(transformers, case.model_class or "AutoModelForCausalLM")
    return cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def _first_top(url: str, ids: list[int], tries: int = 4) -> list[dict]:
    """llama-server's top_logprobs of the first generated token for prompt `ids`. llama-server leaves out the
    probabilities of a token whose text is an incomplete UTF-8 sequence (a byte-level token); then the prompt is
    asked again with that token banned by `logit_bias`, which moves the sampled token but not the raw logits'
    softmax that `top_logprobs` reports (the banned token is still listed there at its raw log-probability)."""
    banned: list[list] = []
    for _ in range(tries):
        body = json.dumps({"prompt": ids, "n_predict": 1, "n_probs": TOP, "temperature": 0, "cache_prompt": False,
                           "return_tokens": True, "logit_bias": banned,
                           "ignore_eos": True}).encode()  # a random model may put an end-of-generation token first
        req = urllib.request.Request(f"{url}/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            answer = json.loads(r.read())
        if "completion_probabilities" in answer:
            return answer["completion_probabilities"][0]["top_logprobs"]
        banned += [[t, False] for t in answer["tokens"]]
    raise RuntimeError(f"llama-server gave no probabilities in {tries} tries: {str(answer)[:300]}")


def reference(case, model, folder: Path, f32: Path, gguf: Path, prompts: list[list[int]], layers: int
              ) -> tuple[torch.Tensor, int]:
    """transformers' float32 log-probabilities at each prompt's last position on the file's dequantized weights,
    and the count of the file's rows not substituted; kept beside the file (`--keep`) and read back when the same
    prompts ask again."""
    cached = gguf.with_name(gguf.name + ".reference.pt")
    if cached.exists():
        saved = torch.load(cached)
        if saved["prompts"] == prompts:
            return saved["ref"], saved["missed"]
    mtp = (f"blk.{layers}.",) if case.mtp_layers else ()  # the MTP block: not in transformers' model
    ref_model, missed = dequantized_reference(fresh_model(case, model, folder), f32, gguf, skip=mtp)
    ref = torch.stack([reference_logits(ref_model, ids)[-1] for ids in prompts]).log_softmax(-1)
    _whole(cached, lambda part: torch.save({"prompts": prompts, "ref": ref, "missed": missed}, part))
    return ref, missed


def llama_server_top(binary: Path, gguf: Path, prompts: list[list[int]]) -> list[list[tuple[int, float]]]:
    """llama-server's top-TOP (token id, logprob) at the first generated position of each prompt."""
    from edgeserve.bench.servers import free_port, start_server, stop_server

    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-c", "256", "-np", "1",
           "-t", "2", "--no-webui"]
    env = dict(os.environ, LD_LIBRARY_PATH=str(binary.parent))
    server = start_server("llama-server", cmd, port, env=env, timeout=600)
    try:
        return [[(t["id"], t["logprob"]) for t in _first_top(server.url, ids)] for ids in prompts]
    finally:
        stop_server(server)


def compare(llama: list[list[tuple[int, float]]], ours: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """The report's numbers: ours / ref are log-probabilities [prompts, vocab]."""
    n = len(llama)
    ids = [[t for t, _ in top] for top in llama]
    lp = torch.tensor([[p for _, p in top] for top in llama])
    ours_at = torch.stack([ours[i, ids[i]] for i in range(n)])
    ref_at = torch.stack([ref[i, ids[i]] for i in range(n)])
    ours_top = ours.topk(TOP, dim=-1).indices.tolist()
    ref_top1 = ref.argmax(-1).tolist()
    return {"agree": sum(ids[i][0] == ours_top[i][0] for i in range(n)),
            "overlap": sum(len(set(ids[i]) & set(ours_top[i])) for i in range(n)) / (TOP * n),
            "diff": (ours_at - lp).abs().mean().item(),
            "llama_ref_top1": sum(ids[i][0] == ref_top1[i] for i in range(n)),
            "ours_ref_top1": sum(ours_top[i][0] == ref_top1[i] for i in range(n)),
            "llama_ref": (lp - ref_at).abs().mean().item(), "ours_ref": (ours_at - ref_at).abs().mean().item()}


def run_case(name: str, outtypes: list[str], tokenizers: dict[str, Path], work: Path, binary: Path,
             prompts: list[list[int]]) -> None:
    """Print one report row per file of case `name`."""
    case = shaped_case(name)
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    f32 = work / f"{name}.f32.gguf"
    if case.post_save is None and f32.exists():  # the folder was saved whole before the f32 file was made of it
        import transformers

        model, config = None, transformers.AutoConfig.from_pretrained(folder)
    else:
        model = build_checkpoint(case, tokenizers[case.tokenizer], folder)  # seeded: the same weights every run
        config = model.config
        if case.post_save is None:
            model = None  # read again from the folder for each file: one model of the big shapes in memory at once
    layers = config.get_text_config().num_hidden_layers
    fix = SHAPED[name].fix or (lambda path: None)
    if not f32.exists():
        _whole(f32, lambda part: (convert(folder, part, *case.convert_args, outtype="f32"), fix(part)))
    for outtype in outtypes:
        try:
            gguf = make_file(outtype, folder, f32, case.convert_args, binary.parent / "llama-quantize")
            fix(gguf)
        except RuntimeError as e:  # e.g. llama-quantize will not requantize gpt-oss's MXFP4 experts
            print(f"| {name} | {outtype} | not made: {str(e).strip().splitlines()[-1][:120]} |", flush=True)
            continue
        ref, missed = reference(case, model, folder, f32, gguf, prompts, layers)
        served = load_ours(gguf, dtype="auto").model
        kvs = ("auto", "bf16") if served.dtype == torch.bfloat16 else ("auto",)  # bf16 KV beside bf16 compute only
        ours, *bf16_kv = (torch.stack([our_logits(served, ids, kv, prompt_len=len(ids))[-1] for ids in prompts])
                          .log_softmax(-1) for kv in kvs)
        bf16_kv = bf16_kv[0] if bf16_kv else None
        del served
        try:
            llama = llama_server_top(binary, gguf, prompts)
        except ServerError as e:  # llama-server will not load the file: a report row, not the end of the run
            print(f"| {name} | {outtype} | llama-server failed: {str(e).strip()[-160:]} |", flush=True)
            continue
        torch.save({"prompts": prompts, "llama": llama, "ours": ours, "bf16_kv": bf16_kv, "ref": ref},
                   gguf.with_name(gguf.name + ".results.pt"))  # for a closer look at a row
        c = compare(llama, ours, ref)
        note = f" {missed} rows not substituted" if missed else ""
        n = len(prompts)
        if bf16_kv is None:  # float32 compute (an F32 file, models.dtype_policy): no bf16 KV pool beside it
            bf16_col = "- (float32 compute)"
        else:
            before = compare(llama, bf16_kv, ref)
            bf16_col = f"{before['ours_ref_top1']}/{n}, {before['ours_ref']:.3f}"
        print(f"| {name} | {outtype} | {c['agree']}/{n} | {c['overlap']:.2f} | {c['diff']:.3f} "
              f"| {c['llama_ref_top1']}/{n} | {c['llama_ref']:.3f} | {c['ours_ref_top1']}/{n} | {c['ours_ref']:.3f} "
              f"| {bf16_col} | {SHAPED[name].note}{note} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = beside_llama_server_parser(__doc__, SHAPED)
    ap.add_argument("--outtypes", default="q8_0,q4_k_m")
    args = ap.parse_args(argv)
    from edgeserve.registry import DEFAULT_MODEL, pull

    binary = llama_server_binary(args.llama_server)
    g = torch.Generator().manual_seed(54)
    prompts = [torch.randint(3, 30000, (PROMPT_LEN,), generator=g).tolist() for _ in range(PROMPTS)]
    with work_folder(args.keep) as work:
        tokenizers = {}
        for kind in ("bpe", "spm"):
            (work / f"tok-{kind}").mkdir(exist_ok=True)
        tokenizers["bpe"] = tokenizer_folder(pull(DEFAULT_MODEL, progress=False), work / "tok-bpe")
        tokenizers["spm"] = spm_tokenizer_folder(work / "tok-spm")
        print("| shape | file | top-1 agree | top-5 overlap | mean abs logprob diff | llama-server top-1 = ref "
              "| llama-server vs ref | edgeserve top-1 = ref | edgeserve vs ref | same, bf16 KV | cut |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for name in args.cases.split(","):
            run_case(name, args.outtypes.split(","), tokenizers, work, binary, prompts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
