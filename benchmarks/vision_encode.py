"""Time edgeserve's vision encoder on one image, on random-weight mmproj files of real shapes (or a given one).

    python benchmarks/vision_encode.py --family smolvlm-256m --qtype F16 --size 512 [--repeat 2] [--keep DIR]

Writes the mmproj (clip.cpp's tensor names, as llama.cpp's converter would) unless --mmproj names one, loads it as
the server does (bf16 compute: Q8_0 matrices on the native CPU kernels, F16 ones as bf16), and prints the
preprocessing and encode seconds (median of --repeat) as JSON. The same file serves llama-server's --mmproj.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image

# the towers and projectors of the real models (their config.json / preprocessor_config.json)
SHAPES = {
    # Gemma 3 4B: SigLIP so400m at 896, average-pooled to 256 tokens, into a 2560-wide LM
    "gemma3-4b": dict(kind="gemma3", hidden=1152, ffn=4304, layers=27, heads=16, patch=14, image=896, lm=2560),
    # SmolVLM-256M-Instruct: SigLIP base at 512 tiles, pixel shuffle 4, into a 576-wide LM, images to 2048 first
    "smolvlm-256m": dict(kind="idefics3", hidden=768, ffn=3072, layers=12, heads=12, patch=16, image=512, lm=576,
                         scale=4, longest=2048),
}


def write_random_mmproj(path: Path, shape: dict, qtype: str, seed: int = 0) -> Path:
    """A random-weight mmproj GGUF of `shape`; the layer matrices stored as `qtype` (F16 or Q8_0)."""
    import gguf

    rng = np.random.default_rng(seed)
    s = SimpleNamespace(**shape)
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_string("clip.projector_type", s.kind)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_gelu", True)
    for key, value in (("embedding_length", s.hidden), ("feed_forward_length", s.ffn), ("block_count", s.layers),
                       ("attention.head_count", s.heads), ("image_size", s.image), ("patch_size", s.patch)):
        w.add_uint32(f"clip.vision.{key}", value)
    w.add_uint32("clip.vision.projection_dim", s.lm)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    if s.kind == "idefics3":
        w.add_uint32("clip.vision.projector.scale_factor", s.scale)
        w.add_uint32("clip.vision.preproc_image_size", s.longest)

    def mat(name: str, rows: int, cols: int, quantize: bool = True) -> None:
        a = (rng.standard_normal((rows, cols), dtype=np.float32) * cols ** -0.5).astype(np.float32)
        if quantize and qtype == "Q8_0":
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, a.astype(np.float16))

    def vec(name: str, n: int, value: float | None = None) -> None:
        w.add_tensor(name, np.full(n, value, np.float32) if value is not None
                     else (rng.standard_normal(n, dtype=np.float32) * 0.02))

    n_pos = (s.image // s.patch) ** 2
    w.add_tensor("v.patch_embd.weight", (rng.standard_normal((s.hidden, 3, s.patch, s.patch), dtype=np.float32)
                                         * 0.02))
    vec("v.patch_embd.bias", s.hidden)
    w.add_tensor("v.position_embd.weight", rng.standard_normal((n_pos, s.hidden), dtype=np.float32) * 0.02)
    for i in range(s.layers):
        for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
            mat(f"v.blk.{i}.{part}.weight", s.hidden, s.hidden)
            vec(f"v.blk.{i}.{part}.bias", s.hidden)
        mat(f"v.blk.{i}.ffn_up.weight", s.ffn, s.hidden)
        vec(f"v.blk.{i}.ffn_up.bias", s.ffn)
        mat(f"v.blk.{i}.ffn_down.weight", s.hidden, s.ffn)
        vec(f"v.blk.{i}.ffn_down.bias", s.hidden)
        for ln in ("ln1", "ln2"):
            vec(f"v.blk.{i}.{ln}.weight", s.hidden, 1.0)
            vec(f"v.blk.{i}.{ln}.bias", s.hidden, 0.0)
    vec("v.post_ln.weight", s.hidden, 1.0)
    vec("v.post_ln.bias", s.hidden, 0.0)
    if s.kind == "gemma3":
        w.add_tensor("mm.input_projection.weight", (rng.standard_normal((s.hidden, s.lm), dtype=np.float32)
                                                    * s.hidden ** -0.5).astype(np.float16))
        vec("mm.soft_emb_norm.weight", s.hidden, 1.0)
    else:
        mat("mm.model.fc.weight", s.lm, s.hidden * s.scale ** 2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=sorted(SHAPES), default="smolvlm-256m")
    ap.add_argument("--qtype", choices=["F16", "Q8_0"], default="F16")
    ap.add_argument("--mmproj", default=None, help="time this file instead of writing a random one")
    ap.add_argument("--keep", default=None, metavar="DIR", help="write the random mmproj here and keep it")
    ap.add_argument("--size", type=int, default=512, help="the image's width and height (default %(default)s)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args()
    from edgeserve.vision.family import load_vision

    shape = SHAPES[args.family]
    folder = Path(args.keep or tempfile.mkdtemp())
    folder.mkdir(parents=True, exist_ok=True)
    path = Path(args.mmproj) if args.mmproj else write_random_mmproj(
        folder / f"mmproj-{args.family}-{args.qtype}.gguf", shape, args.qtype)
    t0 = time.perf_counter()
    family = load_vision(path, SimpleNamespace(hidden_size=shape["lm"]), dtype=getattr(torch, args.dtype))
    load_s = time.perf_counter() - t0
    img = Image.fromarray(np.random.default_rng(1).integers(0, 256, (args.size, args.size, 3), dtype=np.uint8))
    pre, enc = [], []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        prepared = family.preprocess(img)
        pre.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        rows = family.encode([prepared])[0]
        enc.append(time.perf_counter() - t0)
    print(json.dumps({"family": args.family, "qtype": args.qtype, "dtype": args.dtype, "mmproj": str(path),
                      "image": f"{args.size}x{args.size}", "frames": int(prepared.pixel_values.shape[0]),
                      "tokens": int(rows.shape[0]), "threads": torch.get_num_threads(), "load_s": round(load_s, 2),
                      "preprocess_s": round(statistics.median(pre), 3), "encode_s": round(statistics.median(enc), 2),
                      "encode_runs_s": [round(e, 2) for e in enc]}))


if __name__ == "__main__":
    main()
