"""Embedding (and reranking) throughput, edgeserve vs llama.cpp's `llama-server --embedding` (`--reranking`) on the
same GGUF, both servers up at once and requests alternated A/B per round, each after a short settle so neither
runs beside the other's idle-spinning threads: texts/s at 64- and 512-token inputs, batch 1 and 32 (one request
carrying that many inputs), medians and ratios.

    python benchmarks/serve/embed_compare.py --llama-server /path/to/llama-server --model minilm-q8_0.gguf
    python benchmarks/serve/embed_compare.py --llama-server ... --model x.gguf --rerank   # a rank-pooling GGUF
    python benchmarks/serve/embed_compare.py --make-bert base --qtype q8_0 --out bge-base-q8_0.gguf \\
        --convert /path/to/llama.cpp/convert_hf_to_gguf.py --vocab-from /path/to/all-MiniLM-L6-v2
    python benchmarks/serve/embed_compare.py --convert-folder ~/.cache/edgeserve/models/all-MiniLM-L6-v2 --qtype q8_0 \\
        --out minilm-q8_0.gguf --convert /path/to/llama.cpp/convert_hf_to_gguf.py

`--make-bert` writes a random-weight BERT of a real shape (minilm: 384x6, small: 384x12, base: 768x12) through
llama.cpp's own converter, with a real WordPiece vocabulary taken from an encoder folder (the weights are seeded:
the same torch and converter give the same file); with `--rerank`, a one-logit cross-encoder with rank pooling.
`--convert-folder` converts a real encoder folder (all-MiniLM-L6-v2, which `edgeserve pull all-minilm` fetches)
the same way.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from edgeserve.bench.servers import free_port, http_post_json, start_edgeserve, start_server, stop_server

SHAPES = {"minilm": (384, 6, 12, 1536), "small": (384, 12, 12, 1536), "base": (768, 12, 12, 3072)}


def make_bert(shape: str, qtype: str, out: Path, convert: str, vocab_from: Path, rerank: bool = False) -> Path:
    """A random-weight BERT GGUF of `shape` and `qtype`, converted by llama.cpp's convert_hf_to_gguf.py; with
    `rerank` a cross-encoder (one-logit classifier as `cls.output`, the pooling type set to rank)."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    hidden, layers, heads, ffn = SHAPES[shape]
    vocab = (vocab_from / "vocab.txt").read_text().splitlines()
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=ffn, max_position_embeddings=512, num_labels=1)
    with tempfile.TemporaryDirectory() as d:
        (BertForSequenceClassification(cfg) if rerank else BertModel(cfg, add_pooling_layer=False)).save_pretrained(d)
        for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "modules.json",
                  "1_Pooling"):
            src = vocab_from / f
            if src.is_dir():
                shutil.copytree(src, Path(d) / f)
            elif src.exists():
                shutil.copy(src, Path(d) / f)
        # a fixed model name: the converter would otherwise name it after the temporary folder
        subprocess.run([sys.executable, convert, d, "--outtype", qtype, "--outfile", str(out), "--model-name",
                        f"random-bert-{shape}{'-rerank' if rerank else ''}"], check=True, capture_output=True)
    if rerank:
        set_rank_pooling(out)
    return out


def convert_folder(folder: Path, qtype: str, out: Path, convert: str) -> Path:
    """A real Hugging Face encoder folder converted to a GGUF of `qtype` by llama.cpp's convert_hf_to_gguf.py."""
    subprocess.run([sys.executable, convert, str(folder), "--outtype", qtype, "--outfile", str(out)], check=True,
                   capture_output=True)
    return out


def set_rank_pooling(path: Path) -> None:
    """Rewrite the GGUF's `bert.pooling_type` in place to rank (4, llama.cpp's LLAMA_POOLING_TYPE_RANK)."""
    import gguf

    field = gguf.GGUFReader(str(path), "r+").fields["bert.pooling_type"]
    field.parts[field.data[0]][0] = 4


def texts(n_tokens: int, count: int) -> list[str]:
    """`count` different texts of about `n_tokens` WordPiece tokens each ([CLS]/[SEP] included)."""
    words = ["river", "mountain", "blue", "cat", "table", "green", "house", "light", "stone", "water"]
    return [" ".join(words[(i + j) % len(words)] for j in range(n_tokens - 2)) for i in range(count)]


def request(url: str, model: str, rerank: bool, inputs: list[str]) -> float:
    """Seconds for one embeddings (or rerank) request carrying `inputs`; raises on an error reply."""
    t0 = time.perf_counter()
    if rerank:
        body = {"model": model, "query": inputs[0], "documents": inputs[1:]}
        status, body = http_post_json(url + "/v1/rerank", body, timeout=600)
    else:
        status, body = http_post_json(url + "/v1/embeddings", {"input": inputs, "model": model}, timeout=600)
    dt = time.perf_counter() - t0
    if status != 200:
        raise RuntimeError(f"{url}: HTTP {status}: {json.dumps(body)[:300]}")
    return dt


def run(args: argparse.Namespace) -> dict:
    """Both servers up, each workload warmed then alternated for `rounds`; texts/s medians and ratios."""
    flag = "--reranking" if args.rerank else "--embedding"
    port = free_port()
    ctx = 32 * 512
    peer = start_server("llama-server", [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port",
                                         str(port), flag, "-np", "32", "-c", str(ctx), "-b", str(ctx), "-ub", "4096",
                                         "-t", str(args.threads), "-tb", str(args.threads), "--no-webui"], port)
    ours = start_edgeserve(args.model, max_seqs=32)
    results, name = {}, Path(args.model).stem
    try:
        for n_tok in (64, 512):
            for batch in (1, 32):
                # a rerank: a 6-word query, then documents: each pair is n_tok tokens in llama-server's template
                inputs = texts(8, 1) + texts(n_tok - 8, batch) if args.rerank else texts(n_tok, batch)
                # single inputs are short and their latency noisy on a loaded machine: more rounds there
                rounds = 3 * args.rounds if batch == 1 else args.rounds if n_tok * batch < 4096 else args.rounds // 2
                rounds = max(2, rounds)
                times: dict[str, list[float]] = {"edgeserve": [], "llama-server": []}
                for srv in (ours, peer):
                    request(srv.url, name, args.rerank, inputs)  # warm-up
                for r in range(rounds):
                    order = (ours, peer) if r % 2 == 0 else (peer, ours)
                    for srv in order:
                        time.sleep(args.settle)  # the other server's threads idle again (see --settle)
                        times["edgeserve" if srv is ours else "llama-server"].append(
                            request(srv.url, name, args.rerank, inputs))
                tps = {k: batch / statistics.median(v) for k, v in times.items()}
                key = f"{n_tok}tok_b{batch}"
                results[key] = {**{f"{k}_texts_s": round(v, 2) for k, v in tps.items()},
                                "ratio": round(tps["edgeserve"] / tps["llama-server"], 3), "rounds": rounds}
                print(f"{key:>12}  edgeserve {tps['edgeserve']:8.2f} texts/s  llama-server "
                      f"{tps['llama-server']:8.2f} texts/s  ratio {results[key]['ratio']:.2f}x", flush=True)
    finally:
        stop_server(ours)
        stop_server(peer)
    return results


def native_ab(model: str, rounds: int) -> dict:
    """In process: the GGUF loaded with its quantized matrices on the native kernels and again dequantized to
    float32 for torch (`EDGESERVE_NATIVE=0`), embed calls alternated; texts/s medians per workload."""
    import os

    from edgeserve.models.encoders.gguf_encoder import load_gguf_encoder
    from edgeserve.registry import resolve

    models = {}
    for name, flag in (("native", "1"), ("torch", "0")):
        os.environ["EDGESERVE_NATIVE"] = flag
        models[name] = load_gguf_encoder(resolve(model), dtype="float32")
    os.environ.pop("EDGESERVE_NATIVE")
    results = {}
    for n_tok in (64, 512):
        for batch in (1, 32):
            seqs = [models["native"].encode(t)[0] for t in texts(n_tok, batch)]
            times: dict[str, list[float]] = {k: [] for k in models}
            for r in range(max(2, rounds if batch == 1 or n_tok == 64 else rounds // 2) + 1):
                for name in (("native", "torch") if r % 2 == 0 else ("torch", "native")):
                    t0 = time.perf_counter()
                    models[name].embed(seqs)
                    if r:  # round 0 warms up
                        times[name].append(time.perf_counter() - t0)
            tps = {k: batch / statistics.median(v) for k, v in times.items()}
            key = f"{n_tok}tok_b{batch}"
            results[key] = {**{f"{k}_texts_s": round(v, 2) for k, v in tps.items()},
                            "ratio": round(tps["native"] / tps["torch"], 3)}
            print(f"{key:>12}  native {tps['native']:8.2f} texts/s  torch (dequantized) {tps['torch']:8.2f} texts/s"
                  f"  ratio {results[key]['ratio']:.2f}x", flush=True)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-server", help="path to llama.cpp's llama-server")
    p.add_argument("--model", help="the GGUF both servers load")
    p.add_argument("--rerank", action="store_true",
                   help="rerank throughput (the GGUF has rank pooling); with --make-bert, write a cross-encoder")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--settle", type=float, default=0.3,
                   help="seconds to wait before each timed request, so it runs as a lone user's would: after a "
                        "request llama-server keeps a thread busy-waiting for work (its --poll, about 160 ms here), "
                        "and an alternated request would otherwise share a core with it (0: back to back)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--native-ab", action="store_true",
                   help="no servers: the native quantized matmuls vs torch on the dequantized weights, in process")
    p.add_argument("--make-bert", choices=sorted(SHAPES), help="write a random-weight BERT GGUF and exit")
    p.add_argument("--convert-folder", help="convert this Hugging Face encoder folder to a GGUF (--qtype, --out, "
                   "--convert) and exit")
    p.add_argument("--qtype", default="q8_0", help="--make-bert's type (convert_hf_to_gguf --outtype)")
    p.add_argument("--out", help="--make-bert's output path")
    p.add_argument("--convert", help="llama.cpp's convert_hf_to_gguf.py")
    p.add_argument("--vocab-from", help="an encoder folder with vocab.txt / tokenizer.json")
    args = p.parse_args()
    if not args.settle >= 0:  # also NaN
        p.error(f"--settle must be a number of seconds >= 0, not {args.settle}")
    if args.convert_folder:
        if not (args.out and args.convert):
            p.error("--convert-folder needs --out and --convert")
        print(convert_folder(Path(args.convert_folder).expanduser(), args.qtype, Path(args.out), args.convert))
        return 0
    if args.make_bert:
        if not (args.out and args.convert and args.vocab_from):
            p.error("--make-bert needs --out, --convert and --vocab-from")
        print(make_bert(args.make_bert, args.qtype, Path(args.out), args.convert, Path(args.vocab_from), args.rerank))
        return 0
    if args.native_ab and args.model:
        results = native_ab(args.model, args.rounds)
    elif not (args.llama_server and args.model):
        p.error("--llama-server and --model are required (--model alone with --native-ab)")
    else:
        results = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "rerank": args.rerank, **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
