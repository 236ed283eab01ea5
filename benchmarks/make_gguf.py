"""Write a random-weight Llama GGUF of a real shape and quantization mix (no model download needed).

    python benchmarks/make_gguf.py --shape 1b --mix Q4_K_M /tmp/llama-1b-q4km.gguf
    python benchmarks/make_gguf.py --shape 3b --mix Q8_0 /tmp/llama-3b-q8.gguf
    python benchmarks/make_gguf.py --shape gemma3-1b --tokenizer-from GEMMA.gguf /tmp/gemma3-1b-q4km.gguf

The tokenizer comes from --tokenizer-from (default: the default model, pulled into the cache). Shapes: 135m,
1b (Llama-3.2-1B dimensions), 3b (Llama-3.2-3B), gemma3-1b (Gemma 3 1B, architecture gemma3: give it a Gemma
tokenizer, e.g. the gemma3-270m model's); the vocabulary is the tokenizer's. Mixes: Q4_K_M (Q4_K with
Q6_K for the embeddings and part of attn_v / ffn_down, as llama.cpp's quantizer picks), Q8_0, Q4_0.
"""

from __future__ import annotations

import argparse
import sys

from edgeserve.bench.random_gguf import MIXES, SHAPES, write_random_llama


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("output")
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    p.add_argument("--mix", choices=MIXES, default="Q4_K_M")
    p.add_argument("--tokenizer-from", help="GGUF whose tokenizer to copy (default: the default model)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    source = args.tokenizer_from
    if source is None:
        from edgeserve.registry import DEFAULT_MODEL, resolve

        source = resolve(DEFAULT_MODEL).path
    path = write_random_llama(args.output, SHAPES[args.shape], args.mix, source, args.seed)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
