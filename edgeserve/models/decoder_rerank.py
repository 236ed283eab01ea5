"""Decoder rerankers (Qwen3-Reranker) from GGUF: a decoder whose `<arch>.pooling_type` is rank and whose
`cls.output` matrix holds the lm-head rows of its answer tokens (`<arch>.classifier.output_labels`, "yes" / "no"),
as llama.cpp's converter writes Qwen3-Reranker.

Each (query, document) pair is written in Qwen3-Reranker's prompt (a system turn asking for "yes" or "no", the
instruction, query and document in the user turn, an empty think block); the decoder runs causally over a
right-padded batch (decoder_embed's attention), and the last token's state times `cls.output` gives the
("no", "yes") logits, whose softmax "yes" is the relevance score (the rerank route's two-logit rule).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from edgeserve.errors import ModelLoadError
from edgeserve.models.bert import pad_batch
from edgeserve.models.decoder_embed import DecoderEmbedConfig, LoadedDecoderEmbedder, PaddedCausalAttention

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


@dataclass
class LoadedDecoderReranker(LoadedDecoderEmbedder):
    """A decoder reranker ready to run: the decoder, its tokenizer and its ("no", "yes") head [2, hidden]."""

    head: torch.Tensor = field(default_factory=lambda: torch.empty(0))
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
        last = hidden.view(b, t, -1)[torch.arange(b), mask.sum(1) - 1].float()
        return (last @ self.head.T).cpu()


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
    c = lm.config
    head = rank_head(gguf, str(gguf.metadata.get("general.architecture")), lm.model.device)
    limit = min(c.max_position_embeddings, max_len) if max_len else c.max_position_embeddings
    cfg = DecoderEmbedConfig(c.vocab_size, c.hidden_size, limit, "lasttoken", normalize=False)
    out = LoadedDecoderReranker(lm.name or source.path.stem, source, cfg, lm.model, lm.tokenizer, None,
                                lm.model.device, 0.0, head=head)
    out.load_seconds = time.monotonic() - start
    log.info("loaded decoder reranker %s: max %d tokens, in %.2fs", out.name, limit, out.load_seconds)
    return out
