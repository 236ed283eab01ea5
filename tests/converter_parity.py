"""Converter parity: tiny random checkpoints made in transformers, saved as HF folders, converted to GGUF by llama.cpp's
own `convert_hf_to_gguf.py` (the tool that made the GGUFs people download), loaded by edgeserve's loader and compared
with transformers' float32 logits.

The tiny models borrow a real tokenizer, read by transformers from a GGUF and saved beside the weights: the default
model's (SmolLM2's byte-level BPE, 49152 tokens, which the converter recognizes as its `smollm` pre-tokenizer), or for
the families whose converter wants a SentencePiece model (Gemma 2 / 3, Phi-3) or a SentencePiece-style BPE (Gemma 4)
Llama 2's 32000-token vocabulary from llama.cpp's `models/ggml-vocab-llama-spm.gguf`, with a `tokenizer.model`
written from the same vocabulary.
The converter runs as a subprocess of this Python with `PYTHONPATH` at its own `gguf-py`, so it uses its own gguf
package. A checkpoint with an MTP block gets `mtp.*` tensors the way Qwen3.5's real checkpoints store them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from llama_cpp_source import llama_cpp_dir

# token ids of a fixed prompt (inside both borrowed vocabularies), then the decode inputs
PROMPT = [1, 504, 3458, 314, 253, 1837, 28, 2, 1010, 17, 31000, 5, 800, 12000, 31, 7]
DECODES = [40, 41, 9000, 3]
IDS = PROMPT + DECODES
CHUNK = 9  # the prompt in two chunks (across a block boundary), then single-token decode steps
BLOCK = 4


@dataclass(frozen=True)
class Case:
    """One tiny checkpoint: its transformers config (given the vocabulary size), the GGUF architecture llama.cpp's
    converter must write, converter flags, an MTP block to add (`mtp.*`), and how its weights are spread."""

    name: str
    config: Callable[[int], Any]
    arch: str
    convert_args: tuple[str, ...] = ()
    tokenizer: str = "bpe"  # "bpe": SmolLM2's; "spm": Llama 2's SentencePiece vocabulary
    model_class: str | None = None  # the transformers class when not AutoModelForCausalLM's pick
    mtp_layers: int = 0
    init: Callable[[Any], None] | None = None  # re-draws weights in place (default: `spread`)
    # rewrites the saved folder the way the real checkpoint stores it (and the model to its values): (model, folder)
    post_save: Callable[[Any, Path], None] | None = None
    ours: str | None = None  # the registered architecture of the HF folder where not `arch` (Mistral: a llama GGUF)
    # (model, GGUF path, GGML type of the matrices) -> path: our own GGUF writer, for an architecture llama.cpp's
    # converter does not know (LFM3); None: the converter
    writer: Callable[[Any, Path, str], Path] | None = None


def tokenizer_folder(gguf: Path, dest: Path) -> Path:
    """The tokenizer files (tokenizer.json, tokenizer_config.json) transformers makes of a GGUF's vocabulary."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(dest)
    return dest


def spm_tokenizer_folder(dest: Path) -> Path:
    """Llama 2's SentencePiece vocabulary (llama.cpp's ggml-vocab-llama-spm.gguf) as tokenizer.json and as the
    `tokenizer.model` protobuf SentencePiece checkpoints ship (pieces, scores and types as the GGUF stores them)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    from edgeserve.loaders.gguf_file import GGUFFile

    gguf = llama_cpp_dir() / "models" / "ggml-vocab-llama-spm.gguf"
    tokenizer_folder(gguf, dest)
    meta = GGUFFile(gguf).metadata
    model = pb.ModelProto()
    for piece, score, kind in zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"],
                                  meta["tokenizer.ggml.token_type"]):
        model.pieces.add(piece=piece, score=float(score), type=int(kind))  # GGUF token types are SentencePiece's
    model.trainer_spec.model_type = pb.TrainerSpec.BPE
    model.trainer_spec.vocab_size = len(model.pieces)
    model.trainer_spec.byte_fallback = True
    model.trainer_spec.unk_id, model.trainer_spec.bos_id, model.trainer_spec.eos_id = 0, 1, 2
    model.trainer_spec.pad_id = -1
    model.normalizer_spec.name = "identity"
    model.normalizer_spec.add_dummy_prefix = True
    model.normalizer_spec.remove_extra_whitespaces = False
    model.normalizer_spec.escape_whitespaces = True
    (dest / "tokenizer.model").write_bytes(model.SerializeToString())
    return dest


def spread(model) -> None:
    """Random weights that make every part matter: matrices N(0, 0.15), norms and biases N(0, 0.3) around their
    usual centre (1 for a plain RMSNorm weight, 0 for an offset one)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # a slow DeltaNet decay: a state carries far, so a wrong one shows
                p.uniform_(-4.0, -1.5)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.15)
            elif "norm" in name:
                p.normal_(0.0 if p.abs().max() < 1e-6 else 1.0, 0.3)
            else:
                p.normal_(0.0, 0.3)


def build_checkpoint(case: Case, tokenizer: Path, dest: Path):
    """The case's float32 model, saved as an HF folder (weights, config, tokenizer) at `dest`; returns the model."""
    import shutil

    import transformers

    tj = json.loads((tokenizer / "tokenizer.json").read_text())
    vocab = 1 + max([*tj["model"]["vocab"].values(), *(t["id"] for t in tj["added_tokens"])])
    cfg = case.config(vocab)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    if case.model_class:
        model = getattr(transformers, case.model_class)(cfg).float().eval()
    else:
        model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    (case.init or spread)(model)
    model.save_pretrained(dest)
    for f in tokenizer.iterdir():
        shutil.copy(f, dest / f.name)
    if case.post_save is not None:
        case.post_save(model, dest)
    if case.mtp_layers:
        add_mtp_block(dest, case.mtp_layers)
    return model


def add_mtp_block(folder: Path, layers: int) -> None:
    """Qwen3.5's MTP block in the checkpoint: `mtp.fc` over [embedding | hidden], its pre-norms, final norm, and
    `layers` full-attention decoder layers (`mtp.layers.i.*`, shaped as the trunk's last full-attention layer), with
    `mtp_num_hidden_layers` in the (text) config."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    sd = load_file(path)
    cfg = json.loads((folder / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    hidden = int(text["hidden_size"])
    full = [i for i, t in enumerate(text["layer_types"]) if t == "full_attention"][-1]
    g = torch.Generator().manual_seed(7)
    sd["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.1
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        sd[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=g) * 0.3
    prefix = next(p for p in ("model.language_model.", "model.") if f"{p}layers.0.input_layernorm.weight" in sd)
    prefix += f"layers.{full}."
    for i in range(layers):
        for k in [k for k in sd if k.startswith(prefix)]:
            sd[f"mtp.layers.{i}." + k[len(prefix):]] = sd[k] + 0.05 * torch.randn(sd[k].shape, generator=g)
    save_file(sd, path, metadata={"format": "pt"})
    text["mtp_num_hidden_layers"] = layers
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


# The converter's __main__, after telling transformers to take the tokenizer class the folder's tokenizer_config.json
# names: for some model types (qwen2, phi3, qwen3_5_moe, ...) AutoTokenizer otherwise swaps in that family's own
# tokenizer class, which re-splits the borrowed SmolLM2 vocabulary its own way (a pre-tokenizer hash the converter
# does not know). Only the tokenizer is affected; the weights and config go through the converter unchanged.
_CONVERTER_MAIN = """
import runpy, sys
from transformers.models.auto import tokenization_auto
tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS.clear()
sys.argv = sys.argv[1:]
sys.path.insert(0, sys.argv[0].rsplit("/", 1)[0])  # its conversion/ package, as when run as a script
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(folder: Path, outfile: Path, *args: str, outtype: str = "f32") -> Path:
    """`folder` converted by llama.cpp's convert_hf_to_gguf.py; a failure raises with the converter's output."""
    src = llama_cpp_dir()
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    argv = [str(src / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype, "--outfile", str(outfile), *args]
    run = subprocess.run([sys.executable, "-c", _CONVERTER_MAIN, *argv], env=env, capture_output=True, text=True,
                         timeout=600)
    if run.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({run.returncode}):\n{run.stderr[-4000:]}")
    return outfile


def reference_logits(model, ids: list[int] = IDS) -> torch.Tensor:
    """transformers' float32 logits at every position of `ids`."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def load_ours(path: Path, dtype: str = "float32"):
    """The model at `path` (a GGUF file or an HF folder) as the server loads it (computing in float32 by default)."""
    from edgeserve.models.load import load_model
    from edgeserve.registry.resolve import resolve

    return load_model(resolve(str(path), pull_missing=False), dtype=dtype)


def our_logits(model, ids: list[int] = IDS, kv_cache_dtype: str = "auto",
               prompt_len: int = len(PROMPT)) -> torch.Tensor:
    """Our logits at every position of `ids`: the first `prompt_len` (the prompt) in two chunks, then decode steps,
    over the engine's paged KV pool in the format `--kv-cache-dtype kv_cache_dtype` gives this model (and state
    pool for a hybrid)."""
    from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention
    from edgeserve.engine.cache.kv_format import resolve_kv_format
    from edgeserve.engine.cache.state_pool import StatePool, StepStates, state_spec_for
    from edgeserve.kernels.dispatch import AttentionMetadata

    c = model.config
    blocks = (len(ids) + BLOCK - 1) // BLOCK
    pool = KVPool(c, blocks, BLOCK, resolve_kv_format(kv_cache_dtype, c, model.dtype, model.device))
    states = slot = None
    if c.is_hybrid:
        states = StatePool(state_spec_for(c), 1, "cpu")
        slot = states.allocate()
    table = list(range(blocks))
    steps = [(0, CHUNK), (CHUNK, prompt_len)] + [(p, p + 1) for p in range(prompt_len, len(ids))]
    out = []
    with torch.no_grad():
        for a, b in steps:
            meta = AttentionMetadata.build([b - a], [b], [table], list(range(a, b)))
            st = None if states is None else StepStates.build(states, torch.tensor([0, b - a]), torch.tensor([slot]))
            attn = PagedKVAttention(pool, meta, states=st) if st is not None else PagedKVAttention(pool, meta)
            out.append(model.logits(model.forward(torch.tensor(ids[a:b]), torch.arange(a, b), attn)).float())
    return torch.cat(out)


def max_logprob_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |log-probability difference| over every position and the whole vocabulary."""
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return (ours.log_softmax(-1) - ref.log_softmax(-1)).abs().max().item()


# the served-drift cases: a converter case at a width the quantized block formats take (Q4_K: rows of 256)
HIDDEN = 256
WIDER = {"intermediate_size": 512, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 256,
         "hidden_size_per_layer_input": 32}


def widened(config_fn):
    """The case's config at hidden 256 (its feed-forwards 2x wider) and 4-8 layers (its layer pattern repeated)."""

    def make(vocab: int):
        cfg = config_fn(vocab)
        text = cfg.get_text_config()
        text.hidden_size = HIDDEN
        for k, v in WIDER.items():
            if getattr(text, k, None):
                setattr(text, k, v)
        reps = max(1, 6 // text.num_hidden_layers)
        text.num_hidden_layers *= reps
        if getattr(text, "layer_types", None):
            text.layer_types = list(text.layer_types) * reps
        return cfg

    return make
