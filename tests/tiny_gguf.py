"""Write tiny but complete llama-architecture GGUF files (byte-level BPE tokenizer, random weights) for tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from support.gguf_vocab import byte_vocab
from support.gguf_writer import finish

from edgeserve.bench.random_gguf import add_stack_keys


def write_tiny_llama(path: Path, arch: str = "llama", hidden: int = 32, layers: int = 2, heads: int = 4,
                     kv_heads: int = 2, ffn: int = 64, qtype: str = "F32", seed: int = 0,
                     skip_tensor: str | None = None, pooling_type: int | None = None,
                     split_max_tensors: int = 0, context: int = 128,
                     extra_tensors: dict[str, np.ndarray] | None = None,
                     extra_metadata: dict[str, list[str] | int | float] | None = None) -> Path:
    """A GGUF with `arch` metadata, a 262-token byte-level vocab and random weights stored as `qtype`
    (`pooling_type`: llama.cpp's `<arch>.pooling_type`, which makes it an embedding model; `extra_tensors` are
    written as given (float32), `extra_metadata` as string arrays, int32 or float32 values).
    `split_max_tensors`: written as llama.cpp's gguf-split parts of that many tensors (`path` then names the set:
    the parts are PATH_STEM-00001-of-0000N.gguf, ...; the first part's path is returned)."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    add_stack_keys(w, layers, context, hidden, ffn, heads, kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    vocab = _add_byte_tokenizer(w)
    if pooling_type is not None:
        w.add_pooling_type(gguf.PoolingType(pooling_type))
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    hd = hidden // heads
    for i in range(layers):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
            f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (kv_heads * hd, hidden),
            f"blk.{i}.attn_v.weight": (kv_heads * hd, hidden), f"blk.{i}.attn_output.weight": (hidden, hidden),
            f"blk.{i}.ffn_gate.weight": (ffn, hidden), f"blk.{i}.ffn_up.weight": (ffn, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, ffn),
        })
    for name, shape in shapes.items():
        if name != skip_tensor:
            _add_random_tensor(w, name, shape, qtype, rng)
    for name, data in (extra_tensors or {}).items():
        w.add_tensor(name, data.astype(np.float32))
    _add_extra_metadata(w, extra_metadata or {})
    finish(w)
    if split_max_tensors:
        return sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))[0]
    return path


def _add_byte_tokenizer(w) -> int:
    """The 262-token byte-level gpt2 vocabulary (3 control tokens, the bytes, 3 merges) into writer `w`; its size."""
    import gguf

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_vocab() + ["he", "ll", "hell"]
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * 259)
    w.add_token_merges(["h e", "l l", "he ll"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    return len(tokens)


def _add_random_tensor(w, name: str, shape: tuple[int, ...], qtype: str, rng: np.random.Generator) -> None:
    """A random tensor into writer `w`: a vector as 1 + noise in F32, a matrix stored as `qtype`."""
    import gguf

    qt = gguf.GGMLQuantizationType[qtype]
    data = rng.normal(0, 0.3, size=shape).astype(np.float32)
    if len(shape) == 1:
        w.add_tensor(name, data + 1.0)
    elif qtype == "F32":
        w.add_tensor(name, data)
    elif qtype == "Q4_K":  # gguf-py has no Q4_K quantizer: random codes, 6-bit scales/mins, small d and dmin
        w.add_tensor(name, random_q4_k(shape, rng), raw_dtype=qt)
    elif qtype in ("Q5_K", "Q6_K"):  # nor these: random blocks with small scales
        from edgeserve.bench.random_gguf import random_blocks

        w.add_tensor(name, random_blocks(qtype, *shape, rng), raw_dtype=qt)
    else:
        w.add_tensor(name, gguf.quants.quantize(data, qt), raw_dtype=qt)


def _add_extra_metadata(w, extra: dict[str, list[str] | int | float]) -> None:
    """Each key of `extra` into writer `w`: an int as int32, a float as float32, a list as a string array."""
    for key, values in extra.items():
        if isinstance(values, int):
            w.add_int32(key, values)
        elif isinstance(values, float):
            w.add_float32(key, values)
        else:
            w.add_array(key, values)


def random_q4_k(shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Stored Q4_K bytes for a [rows, cols] tensor (cols a multiple of 256): random codes and 6-bit sub-block
    scales and mins, with d and dmin chosen so weights are roughly centred with magnitudes of a few tenths."""
    rows, cols = shape
    n = rows * cols // 256
    blocks = rng.integers(0, 256, size=(n, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.full(n, 0.0005, dtype=np.float16).view(np.uint8).reshape(n, 2)
    blocks[:, 2:4] = np.full(n, 0.00375, dtype=np.float16).view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, cols // 256 * 144)
