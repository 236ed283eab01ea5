"""Random-weight vision models of real shapes for the image benchmarks (issue 35), as files llama-server --mmproj
also loads: an mmproj GGUF (F16 matrices, as published mmproj files are) named as llama.cpp's converter names it,
and a random language-model GGUF of the matching shape.

    python benchmarks/make_mmproj.py --family qwen3vl-2b --out /tmp/vbench

writes mmproj-qwen3vl-2b-f16.gguf and qwen3vl-2b-q4_k_m.gguf (Qwen3-VL-2B-Instruct's shapes: a 24-layer 1024-wide
ViT with DeepStack after layers 5, 11, 17, and its 28-layer 2048-wide language model). `--family gemma3-4b` /
`smolvlm-256m` write those towers' mmproj only (edgeserve.bench.random_mmproj.SIGLIP_SHAPES; no language model:
for SmolVLM, `make_gguf.py --shape smolvlm-256m` writes one with SmolVLM's image tokens);
`--lm-width 640` makes its projector map into 640-wide rows, so the real Gemma 3 270M GGUF can be its language model
(mmproj-gemma3-4b-to640-f16.gguf, the file of the PERFORMANCE sections' vision_ttft / vision_interference runs).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from edgeserve.bench.random_gguf import SHAPES, write_random_llama
from edgeserve.bench.random_mmproj import SIGLIP_SHAPES, write_qwen_mmproj, write_siglip_mmproj

# Qwen3-VL-2B-Instruct's vision_config (config.json)
QWEN3VL_2B_VISION = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
                         patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                         deepstack_visual_indexes=[5, 11, 17])
VOCAB_GGUF = "/work/models/ggml-vocab-qwen2.gguf"


def random_qwen3vl_tower(v: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors (HF names under `visual.`) of a Qwen3-VL tower: matrices N(0, 0.02), norms ones, biases 0."""
    g = torch.Generator().manual_seed(seed)
    h, f, out, p = v["hidden_size"], v["intermediate_size"], v["out_hidden_size"], v["patch_size"]
    wide = h * v["spatial_merge_size"] ** 2

    def m(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    state = {"patch_embed.proj.weight": m(h, 3, v["temporal_patch_size"], p, p), "patch_embed.proj.bias": m(h),
             "pos_embed.weight": m(v["num_position_embeddings"], h)}
    for i in range(v["depth"]):
        b = f"blocks.{i}."
        state.update({b + "norm1.weight": torch.ones(h), b + "norm1.bias": torch.zeros(h),
                      b + "norm2.weight": torch.ones(h), b + "norm2.bias": torch.zeros(h),
                      b + "attn.qkv.weight": m(3 * h, h), b + "attn.qkv.bias": torch.zeros(3 * h),
                      b + "attn.proj.weight": m(h, h), b + "attn.proj.bias": torch.zeros(h),
                      b + "mlp.linear_fc1.weight": m(f, h), b + "mlp.linear_fc1.bias": torch.zeros(f),
                      b + "mlp.linear_fc2.weight": m(h, f), b + "mlp.linear_fc2.bias": torch.zeros(h)})
    mergers = ["merger."] + [f"deepstack_merger_list.{j}." for j in range(len(v["deepstack_visual_indexes"]))]
    for k, name in enumerate(mergers):
        norm = h if k == 0 else wide  # DeepStack's mergers norm after the 2x2 concatenation
        state.update({name + "norm.weight": torch.ones(norm), name + "norm.bias": torch.zeros(norm),
                      name + "linear_fc1.weight": m(wide, wide), name + "linear_fc1.bias": torch.zeros(wide),
                      name + "linear_fc2.weight": m(out, wide), name + "linear_fc2.bias": torch.zeros(out)})
    return {"visual." + k: t for k, t in state.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="qwen3vl-2b", choices=["qwen3vl-2b", *SIGLIP_SHAPES])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vocab", default=VOCAB_GGUF, help="a GGUF whose Qwen2 tokenizer the language model takes")
    ap.add_argument("--mix", default="Q4_K_M", help="the language model's quantization mix")
    ap.add_argument("--lm-width", type=int, default=None, help="a SigLIP tower's projector output width")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.family in SIGLIP_SHAPES:
        shape = dict(SIGLIP_SHAPES[args.family], **({"lm": args.lm_width} if args.lm_width else {}))
        name = f"mmproj-{args.family}{f'-to{args.lm_width}' if args.lm_width else ''}-f16.gguf"
        print(write_siglip_mmproj(args.out / name, shape, "F16"))
        return
    mmproj = args.out / "mmproj-qwen3vl-2b-f16.gguf"
    write_qwen_mmproj(mmproj, QWEN3VL_2B_VISION, random_qwen3vl_tower(QWEN3VL_2B_VISION), qwen3=True,
                      matrix_type="F16")
    lm = write_random_llama(args.out / f"qwen3vl-2b-{args.mix.lower()}.gguf", SHAPES["qwen3vl-2b"], args.mix,
                            args.vocab, tile_mb=16)
    print(mmproj)
    print(lm)


if __name__ == "__main__":
    main()
