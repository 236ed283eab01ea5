"""Write a random-weight Llama-family or Qwen3.5 GGUF of a real shape and quantization mix (no model download).

    python benchmarks/make_gguf.py --shape 1b --mix Q4_K_M /tmp/llama-1b-q4km.gguf
    python benchmarks/make_gguf.py --shape 3b --mix Q8_0 /tmp/llama-3b-q8.gguf
    python benchmarks/make_gguf.py --shape gemma3-1b --tokenizer-from GEMMA.gguf /tmp/gemma3-1b-q4km.gguf
    python benchmarks/make_gguf.py --shape qwen3-30b-a3b --layers 4 /tmp/qwen3-30b-a3b-4layers-q4km.gguf
    python benchmarks/make_gguf.py --shape smolvlm-256m /tmp/smolvlm-256m-q4_k_m.gguf
    python benchmarks/make_gguf.py --shape qwen35-0.8b --tokenizer-from QWEN35.gguf /tmp/qwen35-0.8b-q4km.gguf
    python benchmarks/make_gguf.py --shape gpt-oss-20b --mix MXFP4_MOE --tile-mb 64 --tokenizer-from VOCAB.gguf \
        /tmp/gpt-oss-20b-mxfp4.gguf

The tokenizer comes from --tokenizer-from (default: the default model, pulled into the cache). Shapes: 135m,
1b (Llama-3.2-1B dimensions), 3b (Llama-3.2-3B), gemma3-1b (Gemma 3 1B, architecture gemma3: give it a Gemma
tokenizer, e.g. the gemma3-270m model's), qwen3-30b-a3b (Qwen3-30B-A3B, architecture qwen3moe: 128 experts, 8
per token; over 17 GB with all 48 layers, so --layers N writes the first N), gpt-oss-20b (architecture gpt-oss: 32
experts of 2,880, 4 per token, attention sinks, biases, the vocabulary padded to 201,088 tokens); qwen35-0.8b and
qwen35-2b (Qwen3.5 0.8B / 2B, architecture qwen35: Gated DeltaNet layers with every fourth full attention) and
qwen35moe-35b-a3b (Qwen3.5-35B-A3B, architecture qwen35moe: 256 experts, 8 routed + 1 shared; give these a Qwen3.5
GGUF's tokenizer: its 248k-token embeddings are a third of the 0.8B's weights); smollm3-3b, olmo2-1b, granite3.3-2b,
ministral3-3b and phi4-mini (issue 33's Llama variants at their published sizes, each as its GGUF architecture:
smollm3, olmo2, granite, mistral3, phi3 with fused QKV / gate-up and LongRoPE factors; the tokenizer's vocabulary
padded to the model's); smolvlm-256m (SmolVLM-256M-Instruct's language model: SmolLM2-135M's block, untied,
SmolLM2's vocabulary plus SmolVLM's 128 added tokens at their ids (<global-img>, <row_R_col_C>, <fake_token_around_image>,
<image>, <end_of_utterance>), its chat template: the language model for make_mmproj.py's smolvlm-256m mmproj in both
llama-server and edgeserve); gemma4-e2b (Gemma 4 E2B's text stack, architecture gemma4: per-layer embeddings, the last 20
of 35 layers KV-shared with double-wide MLPs, 256- and 512-wide heads; give it a Gemma tokenizer), gemma4-12b (Gemma 4
12B's text stack as llama.cpp writes HF `gemma4_unified`, architecture gemma4: 48 layers of 3,840, every sixth global
with one K/V head and V = K, no per-layer embeddings; 7 GB at Q4_K_M, so --layers N for two engines side by side).
The vocabulary is the tokenizer's unless the shape pads it. lfm2.5-1.2b: LFM2 / LFM2.5-1.2B, architecture lfm2 (10
short-conv and 6 attention layers; the tokenizer's vocabulary padded to 65,536; Q4_K_M, Q8_0 or Q4_0); lfm3-1.7b:
LFM3-1.7B, architecture lfm3 (our extension of lfm2's keys: llama.cpp has no lfm3; 13 short-conv, 5 sliding-window
and 6 global layers; vocabulary padded to 128,000); lfm2-8b-a1b: LFM2-8B-A1B, architecture lfm2moe (18 short-conv
and 6 attention layers, 2 dense then 32 experts of 1,792, 4 a token).
nemotron3-nano-4b (Nemotron 3 Nano 4B, architecture nemotron_h: 21 Mamba-2, 17 MLP and 4 attention blocks),
nemotron3-nano-30b-a3b (Nemotron 3 Nano 30B-A3B, nemotron_h_moe: 23 Mamba-2, 23 MoE blocks of 128 squared-ReLU
experts of 1,856, 6 a token, beside a shared 3,712, and 6 attention blocks), granite4-h-tiny (Granite 4 H Tiny,
granitehybrid: 36 Mamba-2 and 4 attention layers, 64 experts of 512, 6 a token, beside a shared 1,024) and
granite4-h-micro (Granite 4 H Micro, granitehybrid dense): vocabularies padded to theirs (Q4_K_M, Q8_0 or Q4_0).
Mixes: Q4_K_M (Q4_K with Q6_K for the embeddings and part of attn_v / ffn_down, Q5_K for a DeltaNet's attn_qkv, as
llama.cpp's quantizer picks), Q8_0, Q4_0, MXFP4_MOE (llama.cpp's gpt-oss files: MXFP4 experts, Q8_0 elsewhere).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from edgeserve.bench.random_gemma4_gguf import GEMMA4_SHAPES, write_random_gemma4
from edgeserve.bench.random_gguf import MIXES, SHAPES, write_random_llama
from edgeserve.bench.random_hybrid_gguf import HYBRID_SHAPES, write_random_hybrid
from edgeserve.bench.random_lfm2_gguf import LFM2_SHAPES, write_random_lfm2
from edgeserve.bench.random_mamba2_gguf import MAMBA2_SHAPES, with_layers, write_random_mamba2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("output")
    p.add_argument("--shape", choices=sorted({**SHAPES, **HYBRID_SHAPES, **GEMMA4_SHAPES, **LFM2_SHAPES,
                                              **MAMBA2_SHAPES}),
                   default="1b")
    p.add_argument("--mix", choices=MIXES, default="Q4_K_M")
    p.add_argument("--tokenizer-from", help="GGUF whose tokenizer to copy (default: the default model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, help="write only this many layers of the shape")
    p.add_argument("--tile-mb", type=int, default=None,
                   help="repeat one random draw of about this many MB per tensor (fast for shapes of many GB)")
    args = p.parse_args(argv)
    source = args.tokenizer_from
    if source is None:
        from edgeserve.registry import DEFAULT_MODEL, resolve

        source = resolve(DEFAULT_MODEL).path
    shape = (SHAPES.get(args.shape) or HYBRID_SHAPES.get(args.shape) or LFM2_SHAPES.get(args.shape)
             or MAMBA2_SHAPES.get(args.shape) or GEMMA4_SHAPES[args.shape])
    if args.layers is not None:
        if args.layers < 1:
            p.error("--layers must be at least 1")
        extra = {"kv_shared_layers": shape.kv_shared_layers * args.layers // shape.layers} \
            if args.shape in GEMMA4_SHAPES else {}  # the same share of KV-shared layers
        shape = with_layers(shape, args.layers) if args.shape in MAMBA2_SHAPES else \
            dataclasses.replace(shape, layers=args.layers, **extra)
    if args.shape in GEMMA4_SHAPES:
        path = write_random_gemma4(args.output, shape, args.mix, source, args.seed, args.tile_mb)
    elif args.shape in HYBRID_SHAPES:
        path = write_random_hybrid(args.output, shape, args.mix, source, args.seed)
    elif args.shape in LFM2_SHAPES:
        path = write_random_lfm2(args.output, shape, args.mix, source, args.seed, tile_mb=args.tile_mb)
    elif args.shape in MAMBA2_SHAPES:
        path = write_random_mamba2(args.output, shape, args.mix, source, args.seed, tile_mb=args.tile_mb)
    else:
        path = write_random_llama(args.output, shape, args.mix, source, args.seed, args.tile_mb)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
