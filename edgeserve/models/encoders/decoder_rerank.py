"""Decoder rerankers (Qwen3-Reranker) from GGUF: a decoder whose `<arch>.pooling_type` is rank and whose
`cls.output` matrix holds the lm-head rows of its answer tokens (`<arch>.classifier.output_labels`, "yes" / "no"),
as llama.cpp's converter writes Qwen3-Reranker; or from a Hugging Face causal-LM folder that sentence-transformers
publishes as a reranker (modules.json with a LogitScore module, whose config names the "yes" / "no" token ids) or
whose folder name says Reranker (Qwen/Qwen3-Reranker-* as published before that), scored with the lm head's rows
of those two tokens.

Each (query, document) pair is written in Qwen3-Reranker's prompt (a system turn asking for "yes" or "no", the
instruction, query and document in the user turn, an empty think block); the decoder runs causally over a
right-padded batch (decoder_embed's attention), and the last token's state times `cls.output` gives the
("no", "yes") logits, whose softmax "yes" is the relevance score (the rerank route's two-logit rule).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from edgeserve.errors import ModelLoadError
from edgeserve.models.encoders.bert import pad_batch
from edgeserve.models.encoders.decoder_embed import DecoderEmbedConfig, LoadedDecoderEmbedder, PaddedCausalAttention

log = logging.getLogger(__name__)

RANK_POOLING = 4
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
          "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def is_decoder_reranker(metadata: Mapping[str, Any]) -> bool:
    """Whether a GGUF's pooling type is rank and it has a `cls.output` head (checked on load)."""
    arch = metadata.get("general.architecture")
    return metadata.get(f"{arch}.pooling_type") == RANK_POOLING


def _logit_score_config(folder: Path) -> dict | None:
    """The config of a folder's sentence-transformers LogitScore module ({} when it has none of its own), or None
    when modules.json declares no LogitScore."""
    try:
        modules = json.loads((folder / "modules.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for m in modules if isinstance(modules, list) else []:
        if isinstance(m, dict) and str(m.get("type", "")).endswith("LogitScore"):
            try:
                cfg = json.loads((folder / str(m.get("path", "")) / "config.json").read_text(encoding="utf-8"))
            except (OSError, ValueError):
                cfg = {}
            return cfg if isinstance(cfg, dict) else {}
    return None


def is_decoder_rerank_folder(path: Path) -> bool:
    """Whether a Hugging Face folder holds a causal LM published as a yes/no reranker: a LogitScore module in its
    modules.json, or (as Qwen3-Reranker was first published) "reranker" in the folder's name."""
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    archs = cfg.get("architectures") if isinstance(cfg, dict) else None
    if not archs or not str(archs[0]).endswith("ForCausalLM"):
        return False
    return _logit_score_config(path) is not None or "reranker" in path.name.lower()


@dataclass
class LoadedDecoderReranker(LoadedDecoderEmbedder):
    """A decoder reranker ready to run: the decoder, its tokenizer and its ("no", "yes") head: rows [2, hidden]
    (a GGUF's cls.output), or the two token ids whose lm-head logits score (a Hugging Face folder)."""

    head: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    label_ids: tuple[int, int] | None = None  # ("no", "yes") token ids, read off the model's logits
    is_reranker: bool = True
    output_dim: int = 2

    def encode_pair(self, query: str, document: str) -> tuple[list[int], int]:
        """(ids of the prompt for the pair, the document cut from its end to fit the model's limit; the untruncated
        token count)."""
        enc = lambda text: self.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        start = f"{PREFIX}<Instruct>: {INSTRUCTION}\n<Query>: {query}\n<Document>: "
        ids, limit = enc(f"{start}{document}{SUFFIX}"), self.config.max_seq_length
        if len(ids) <= limit:
            return ids, len(ids)
        head, tail = enc(start), enc(SUFFIX)
        return head + enc(document)[: max(0, limit - len(head) - len(tail))] + tail, len(ids)

    @torch.inference_mode()
    def embed(self, batch: list[list[int]]) -> torch.Tensor:
        """[len(batch), 2] float32 ("no", "yes") logits of prompt sequences (from encode_pair)."""
        input_ids, mask = pad_batch(batch)
        b, t = input_ids.shape
        hidden = self.model.forward(input_ids.flatten().to(self.device), torch.arange(t).repeat(b).to(self.device),
                                    PaddedCausalAttention(b, t))
        last = hidden.view(b, t, -1)[torch.arange(b), mask.sum(1) - 1]
        if self.label_ids is not None:
            return self.model.logits(last)[:, list(self.label_ids)].float().cpu()
        return (last.float() @ self.head.T).cpu()


def rank_head(gguf: Any, arch: str, device: torch.device) -> torch.Tensor:
    """`cls.output` as float32 [2, hidden] rows ("no", "yes") per `<arch>.classifier.output_labels`."""
    if "cls.output.weight" not in set(gguf.tensor_names()):
        raise ModelLoadError(f"{gguf.path}: pooling type rank but no cls.output tensor (a decoder reranker's "
                             "yes/no rows of the lm head, as llama.cpp converts Qwen3-Reranker)")
    w = gguf.load_tensor("cls.output.weight", torch.float32)
    labels = [str(x).lower() for x in gguf.metadata.get(f"{arch}.classifier.output_labels") or ["yes", "no"]]
    if w.shape[0] != 2 or sorted(labels) != ["no", "yes"]:
        raise ModelLoadError(f"{gguf.path}: a decoder reranker head needs the labels yes and no, got {labels}")
    return w[[labels.index("no"), labels.index("yes")]].to(device)


def load_decoder_reranker(source: Any, device: str = "cpu", dtype: str = "auto",
                          max_len: int | None = None) -> LoadedDecoderReranker:
    """Load a decoder GGUF with pooling type rank (Qwen3-Reranker) as a reranker; `max_len` caps its context."""
    from edgeserve.loaders.gguf_file import GGUFFile
    from edgeserve.models.load import load_model

    start = time.monotonic()
    gguf = GGUFFile(source.path)
    lm = load_model(source, dtype=dtype, device=device, dense_prefill="off")
    head = rank_head(gguf, str(gguf.metadata.get("general.architecture")), lm.model.device)
    return _loaded_reranker(source, lm, lm.name or source.path.stem, max_len, start, "", head=head)


def answer_ids(folder: Path, tokenizer: Any) -> tuple[int, int]:
    """The ("no", "yes") token ids a folder's reranker scores: its LogitScore config's false/true ids, else the
    tokenizer's single tokens "no" and "yes"."""
    from edgeserve.errors import ModelLoadError

    cfg = _logit_score_config(folder) or {}
    ids = cfg.get("false_token_id"), cfg.get("true_token_id")
    if all(isinstance(i, int) for i in ids):
        return ids[0], ids[1]
    found = tuple(tokenizer.backend.token_to_id(word) for word in ("no", "yes"))
    if None in found:
        raise ModelLoadError(f"{folder}: a yes/no reranker needs the tokens 'yes' and 'no' (or a LogitScore module "
                             "naming its token ids); the tokenizer lacks them")
    return found[0], found[1]


def load_hf_decoder_reranker(source: Any, device: str = "cpu", dtype: str = "auto",
                             max_len: int | None = None) -> LoadedDecoderReranker:
    """Load a causal-LM reranker folder (see is_decoder_rerank_folder); `max_len` caps its context."""
    from edgeserve.models.load import load_model

    start = time.monotonic()
    folder = Path(source.path)
    lm = load_model(source, dtype=dtype, device=device, dense_prefill="off")
    return _loaded_reranker(source, lm, lm.name or folder.name, max_len, start, " folder",
                            label_ids=answer_ids(folder, lm.tokenizer))


def _loaded_reranker(source: Any, lm: Any, name: str, max_len: int | None, start: float, kind: str,
                     **scoring: Any) -> LoadedDecoderReranker:
    """The LoadedDecoderReranker over the loaded decoder `lm` (context capped at `max_len`), scoring with
    `scoring` (head= or label_ids=); logs the load time since `start` (`kind`: " folder" for a folder)."""
    c = lm.config
    limit = min(c.max_position_embeddings, max_len) if max_len else c.max_position_embeddings
    cfg = DecoderEmbedConfig(c.vocab_size, c.hidden_size, limit, "lasttoken", normalize=False)
    out = LoadedDecoderReranker(name, source, cfg, lm.model, lm.tokenizer, None, lm.model.device, 0.0, **scoring)
    out.load_seconds = time.monotonic() - start
    log.info("loaded decoder reranker%s %s: max %d tokens, in %.2fs", kind, out.name, limit, out.load_seconds)
    return out
