"""Encoders (embedding models and rerankers) beside llama.cpp's llama-server on the same random-weight GGUFs of real
shapes (issue 54), with transformers' float32 on the same weights as the judge.

Each case is a checkpoint with a real model's widths and vocabulary and fewer layers, random weights (matrices
N(0, 1/fan_in), LayerNorms N(1, 0.3), biases N(0, 0.1); a reranker's head sized so scores spread over a few units),
saved as the real folder is (tokenizer files, sentence-transformers pooling), converted by llama.cpp's own
convert_hf_to_gguf.py to f32, f16 and q8_0 GGUFs (`--outtypes`):
- bge-reranker-v2-m3: XLMRobertaForSequenceClassification, XLM-R's real 250002-token SentencePiece vocabulary
  (tests/xlmr_vocab.py), scored on 1 query x 8 documents through llama-server's /v1/rerank (`--reranking`);
- bge-m3: XLMRobertaModel, the same vocabulary, CLS pooling, 8 texts through /v1/embeddings (`--embedding`);
- nomic-embed-text-v1.5 and jina-embeddings-v2-base-en (f32 files only: the reference reads the checkpoint's own
  tensors): the real config.json and tensor names at the real widths (768, 12 heads, 3072-wide GLU), MiniLM's
  WordPiece vocabulary, mean pooling; the reference is tests/encoder_references.py's float64 code from the published
  definitions (transformers 5's NomicBertModel agrees with it to 1e-5; it has no JinaBert class).
For each file: edgeserve in process as the server computes it (load_embedding_model at dtype auto), llama-server
with its defaults (flash attention auto, 2 threads) and with `-fa off`, and the reference: transformers float32 on
the file's own (dequantized) weights, its ids from the folder's tokenizer (every engine's ids are checked equal to
them first); llama-server is also compared with the reference recomputed with llama.cpp's GELU (`ggml_gelu`: the
tanh approximation through a float16 table), which shows how much of its distance that GELU is.
Reported per engine: max |score - reference| (rerankers) or min cosine / max |component diff| of the normalized
embeddings (embedders), and whether the ranking matches the reference's. About 5 minutes a file type on a 2-core
machine, 3-4 GB of memory (the 250002 x 1024 embedding table, three times).

    .venv/bin/python benchmarks/quality/encoders_beside_llama_server.py [--cases bge-reranker-v2-m3,bge-m3]
        [--outtypes f32,f16,q8_0] [--layers 2] [--llama-server PATH] [--keep DIR]
    .venv/bin/python benchmarks/quality/encoders_beside_llama_server.py \
        --cases nomic-embed-text-v1.5,jina-embeddings-v2-base-en
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from converter_parity import convert  # noqa: E402
from xlmr_vocab import XLMR_VOCAB, xlmr_tokenizer_folder  # noqa: E402

from edgeserve.bench.servers import beside_llama_server_parser, llama_server_binary, work_folder  # noqa: E402

QUERY = "What is the capital city of France?"
DOCUMENTS = [
    "Paris is the capital and most populous city of France.",
    "The Eiffel Tower was completed in 1889.",
    "Berlin ist die Hauptstadt Deutschlands.",
    "巴黎是法国的首都。",
    "Bananas are rich in potassium and fibre.",
    "La capitale de la France est Paris, sur la Seine.",
    "A capital letter begins every sentence.",
    "Lyon is known for its cuisine and silk history.",
]
HEAD_SCALE = 0.15  # the reranker's out_proj weights: scores of a few units over tanh features of width 1024


@dataclass(frozen=True)
class EncoderCase:
    """A real encoder's shape: its transformers config (layers given), model class, and what the GGUF serves."""

    name: str
    config: Callable[[int], Any]
    model_class: str
    kind: str  # "rerank" or "embedding"
    pooling: str = "cls"
    note: str = ""


def _xlmr(layers: int, **extra):
    from transformers import XLMRobertaConfig

    return XLMRobertaConfig(vocab_size=XLMR_VOCAB, hidden_size=1024, num_hidden_layers=layers,
                            num_attention_heads=16, intermediate_size=4096, max_position_embeddings=8194,
                            type_vocab_size=1, layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                            **extra)


CASES = {
    "bge-reranker-v2-m3": EncoderCase("bge-reranker-v2-m3", lambda n: _xlmr(n, num_labels=1),
                                      "XLMRobertaForSequenceClassification", "rerank", note="of 24 layers"),
    "bge-m3": EncoderCase("bge-m3", _xlmr, "XLMRobertaModel", "embedding", note="of 24 layers"),
}


REMOTE = {"nomic-embed-text-v1.5": "of 12 layers", "jina-embeddings-v2-base-en": "of 12 layers"}
REMOTE_WIDTH, REMOTE_HEADS, REMOTE_FFN, WORDPIECE = 768, 12, 3072, 30522


def remote_case(name: str, layers: int, folder: Path) -> tuple[Callable[[list[int]], torch.Tensor], Path]:
    """A remote-code embedder's checkpoint saved at `folder` (its matrices scaled to the width) and its float64
    reference: ids -> normalized mean-pooled embedding."""
    from encoder_references import jina_reference, jina_state, nomic_reference, nomic_state
    from test_converter_parity_encoders import jina_config, nomic_config, remote_code_folder

    from edgeserve.registry import pull

    h, heads, ffn = REMOTE_WIDTH, REMOTE_HEADS, REMOTE_FFN
    if name.startswith("nomic"):
        sd, config = nomic_state(h, layers, ffn, WORDPIECE), nomic_config(h, layers, heads, ffn, WORDPIECE, 1000.0)
        ref = lambda ids: nomic_reference(sd, ids, heads, layers, 1000.0, 1e-12)  # noqa: E731
    else:
        sd, config = jina_state(h, layers, ffn, WORDPIECE, fused=True, qk_norm=False), jina_config(h, layers, heads,
                                                                                                   ffn, WORDPIECE)
        ref = lambda ids: jina_reference(sd, ids, heads, layers, ffn, 1e-12)  # noqa: E731
    for k, v in sd.items():  # 0.2 is the tests' scale at width 32: keep the activations of that order here
        if v.dim() == 2 and "embeddings" not in k:
            v.mul_((32 / v.shape[1]) ** 0.5)
    real = {k.replace("mlp.up_gated_layer.", "mlp.gated_layers."): v for k, v in sd.items()}
    if not (folder / "config.json").exists():
        remote_code_folder(pull("all-minilm", progress=False), folder, config, real)
    return ref, folder


def run_remote_case(name: str, layers: int, work: Path, binary: Path) -> None:
    """Rows for a remote-code embedder's f32 file: edgeserve and llama-server against the float64 reference."""
    import tokenizers

    ref_fn, folder = remote_case(name, layers, work / f"{name}-{layers}l")
    gguf = work / f"{name}-{layers}l.f32.gguf"
    if not gguf.exists():
        convert(folder, gguf, outtype="f32")
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    ref_ids = [tok.encode(d).ids for d in DOCUMENTS]
    ref = torch.stack([ref_fn(ids) for ids in ref_ids]).float()
    case = EncoderCase(name, lambda n: None, "", "embedding", "mean")
    our_ids, got = ours(case, gguf)
    assert our_ids == ref_ids, "edgeserve tokenizes differently from the checkpoint's tokenizer"
    print(row(case, "f32", "edgeserve (dtype auto)", got, ref), flush=True)
    for flash in ("auto", "off"):
        ll_ids, ll = llama_server(case, binary, gguf, flash, specials=(ref_ids[0][0], ref_ids[0][-1]))
        if ll_ids != ref_ids:
            print(f"| {name} | f32 | llama-server | token ids differ from the reference's |")
        print(row(case, "f32", f"llama-server -fa {flash}", ll, ref), flush=True)


def randomize(model) -> None:
    """Random weights that make every part matter (see the module docstring)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, (HEAD_SCALE if "out_proj" in name else 1.0 / p.shape[-1] ** 0.5))
            elif "LayerNorm.weight" in name:
                p.normal_(1.0, 0.3)
            else:
                p.normal_(0.0, 0.1)


def build(case: EncoderCase, layers: int, tokenizer: Path, folder: Path):
    """The case's float32 model (seeded), saved at `folder` with the tokenizer and pooling files; returns it."""
    import shutil

    import transformers

    torch.manual_seed(0)
    cfg = case.config(layers)
    cfg._attn_implementation = "eager"
    model = getattr(transformers, case.model_class)(cfg).float().eval()
    if case.model_class == "XLMRobertaModel" and model.pooler is not None:
        model.pooler = None  # bge-m3 has none; the converter drops it anyway
    randomize(model)
    if (folder / "config.json").exists():
        return model
    model.save_pretrained(folder)
    for f in tokenizer.iterdir():
        shutil.copy(f, folder / f.name)
    if case.kind == "embedding":
        (folder / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
        (folder / "1_Pooling").mkdir(exist_ok=True)
        (folder / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": cfg.hidden_size, "pooling_mode_cls_token": case.pooling == "cls",
            "pooling_mode_mean_tokens": case.pooling == "mean"}))
    return model


class GgmlGelu(torch.nn.Module):
    """GELU as llama.cpp's CPU backend computes `ggml_gelu` (GGML_GELU_FP16): the tanh approximation, looked up in
    a table indexed by the input rounded to float16 and holding float16 values; x itself at or above 10, 0 at or
    below -10."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.gelu(x.half().float(), approximate="tanh").half().float()
        return torch.where(x >= 10, x, torch.where(x <= -10, torch.zeros_like(x), y))


def with_gelu(model, act: torch.nn.Module) -> None:
    """Every layer's feed-forward activation of a transformers XLM-R model set to `act`."""
    body = model.roberta if hasattr(model, "roberta") else model
    for layer in body.encoder.layer:
        layer.intermediate.intermediate_act_fn = act


def reference(case: EncoderCase, model, tokenizer) -> tuple[list[list[int]], torch.Tensor]:
    """The reference's token ids and outputs: pair scores [8] or normalized embeddings [8, hidden]."""
    if case.kind == "rerank":
        ids = [tokenizer(QUERY, d).input_ids for d in DOCUMENTS]
    else:
        ids = [tokenizer(d).input_ids for d in DOCUMENTS]
    out = []
    with torch.no_grad():
        for seq in ids:
            x = torch.tensor([seq])
            if case.kind == "rerank":
                out.append(model(input_ids=x).logits[0, 0])
            else:
                h = model(input_ids=x).last_hidden_state[0]
                out.append(F.normalize(h[0] if case.pooling == "cls" else h.mean(0), dim=-1))
    return ids, torch.stack(out)


def ours(case: EncoderCase, gguf: Path) -> tuple[list[list[int]], torch.Tensor]:
    """edgeserve's token ids and outputs on the GGUF as the server computes them (dtype auto)."""
    from edgeserve.models.encoders.embedders import load_embedding_model
    from edgeserve.registry.resolve import resolve

    lm = load_embedding_model(resolve(str(gguf), pull_missing=False), dtype="auto")
    if case.kind == "rerank":
        ids = [lm.encode_pair(QUERY, d)[0] for d in DOCUMENTS]
        return ids, lm.embed(ids)[:, 0]
    ids = [lm.encode(d)[0] for d in DOCUMENTS]
    return ids, lm.embed(ids)


def _post(url: str, body: dict) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def llama_server(case: EncoderCase, binary: Path, gguf: Path, flash: str, specials: tuple[int, int] = (0, 2)
                 ) -> tuple[list[list[int]], torch.Tensor]:
    """llama-server's token ids (/tokenize, specials (start, end): XLM-R's by default, added as its rerank /
    embedding paths add them) and outputs."""
    from edgeserve.bench.servers import free_port, start_server, stop_server

    port = free_port()
    mode = "--reranking" if case.kind == "rerank" else "--embedding"
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-c", "512", "-np", "1",
           "-t", "2", "--no-webui", mode, "-fa", flash]
    env = dict(os.environ, LD_LIBRARY_PATH=str(binary.parent))
    server = start_server("llama-server", cmd, port, env=env, timeout=600)
    try:
        tok = lambda text: _post(f"{server.url}/tokenize", {"content": text})["tokens"]  # noqa: E731
        if case.kind == "rerank":
            q = tok(QUERY)
            ids = [[0, *q, 2, 2, *tok(d), 2] for d in DOCUMENTS]  # format_prompt_rerank with add_bos/eos/sep
            res = _post(f"{server.url}/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})["results"]
            scores = torch.zeros(len(DOCUMENTS))
            for r in res:
                scores[r["index"]] = r["relevance_score"]
            return ids, scores
        ids = [[specials[0], *tok(d), specials[1]] for d in DOCUMENTS]
        data = _post(f"{server.url}/v1/embeddings", {"input": DOCUMENTS})["data"]
        return ids, torch.tensor([d["embedding"] for d in sorted(data, key=lambda d: d["index"])])
    finally:
        stop_server(server)


def row(case: EncoderCase, outtype: str, engine: str, got: torch.Tensor, ref: torch.Tensor) -> str:
    """One report row: an engine's distance from the reference."""
    if case.kind == "rerank":
        same = got.argsort(descending=True).tolist() == ref.argsort(descending=True).tolist()
        spread = f"scores {ref.min().item():.2f} .. {ref.max().item():.2f}"
        return (f"| {case.name} | {outtype} | {engine} | max abs score diff {(got - ref).abs().max().item():.5f} "
                f"({spread}) | ranking {'same' if same else 'differs'} |")
    cos = F.cosine_similarity(got.double(), ref.double(), dim=-1).min().item()
    return (f"| {case.name} | {outtype} | {engine} | min cosine {cos:.7f}, max abs component diff "
            f"{(got - ref).abs().max().item():.2e} | |")


def with_file_weights(model, gguf: Path) -> None:
    """`model`'s weights replaced by the GGUF's dequantized values (so a 16-bit or quantized file's rounding is not
    counted, only the engines' compute): names mapped back through edgeserve's encoder names, RoBERTa's first
    pad_token_id + 1 position rows (which the converter cut) kept."""
    from edgeserve.loaders.gguf_file import GGUFFile
    from edgeserve.models.encoders.gguf_encoder import encoder_name

    params = dict(model.named_parameters())
    prefix = "roberta." if "roberta.embeddings.word_embeddings.weight" in params else ""
    g = GGUFFile(gguf)
    with torch.no_grad():
        for name in g.tensor_names():
            ours = encoder_name(name)
            if ours is None:
                continue
            p = params[ours if ours.startswith("classifier.") else prefix + ours]
            value = g.load_tensor(name, torch.float32).reshape(-1, *p.shape[1:])
            p[p.shape[0] - value.shape[0]:] = value


def run_case(case: EncoderCase, layers: int, outtypes: list[str], work: Path, binary: Path) -> None:
    """Print the case's rows for each file type (and the token-id check)."""
    from transformers import AutoTokenizer

    tok_dir = work / "xlmr-tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        xlmr_tokenizer_folder(tok_dir)
    folder = work / f"{case.name}-{layers}l"
    model = build(case, layers, tok_dir, folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    for outtype in outtypes:
        gguf = work / f"{case.name}-{layers}l.{outtype}.gguf"
        if not gguf.exists():
            convert(folder, gguf, outtype=outtype)
        with_file_weights(model, gguf)
        ref_ids, ref = reference(case, model, tokenizer)
        our_ids, got = ours(case, gguf)
        assert our_ids == ref_ids, "edgeserve tokenizes differently from the checkpoint's tokenizer"
        print(row(case, outtype, "edgeserve (dtype auto)", got, ref), flush=True)
        with_gelu(model, GgmlGelu())
        _, ref_ggml = reference(case, model, tokenizer)
        with_gelu(model, torch.nn.GELU())
        for flash in ("auto", "off"):
            ll_ids, ll = llama_server(case, binary, gguf, flash)
            if ll_ids != ref_ids:
                print(f"| {case.name} | {outtype} | llama-server | token ids differ from the reference's |")
            print(row(case, outtype, f"llama-server -fa {flash}", ll, ref), flush=True)
            print(row(case, outtype, f"llama-server -fa {flash} vs the reference with ggml's GELU", ll, ref_ggml),
                  flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = beside_llama_server_parser(__doc__, [*CASES, *REMOTE])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--outtypes", default="f32,f16,q8_0", help="the converter's --outtype for each file")
    args = ap.parse_args(argv)
    binary = llama_server_binary(args.llama_server)
    with work_folder(args.keep) as work:
        print("| shape | file | engine | vs transformers float32 on the file's weights | |\n"
              "| --- | --- | --- | --- | --- |")
        for name in args.cases.split(","):
            if name in REMOTE:
                run_remote_case(name, args.layers, work, binary)
            else:
                run_case(CASES[name], args.layers, args.outtypes.split(","), work, binary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
