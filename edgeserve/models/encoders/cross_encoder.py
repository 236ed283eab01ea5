"""Cross-encoder rerankers: a BERT-family encoder reads `[CLS] query [SEP] document [SEP]` and a classification
head on the [CLS] state scores the pair (bge-reranker, ms-marco MiniLM cross-encoders).

The head is `out_proj(tanh(dense(cls)))`: BERT's pooler + classifier, RoBERTa's classification head, and llama.cpp's
`cls` + `cls.output` tensors (pooling type rank) are all this form. A reranker has the LoadedEncoder interface, so
the EmbeddingEngine batches it; its "embedding" of a pair is the head's logits (`output_dim` of them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from edgeserve.errors import ModelLoadError
from edgeserve.models.encoders.bert import LoadedEncoder, pad_batch, segment_ids

# BERT's Hugging Face head names -> ours (RoBERTa's `classifier.dense` / `classifier.out_proj` are ours already)
_BERT_HEAD = {"pooler.dense": "classifier.dense", "classifier": "classifier.out_proj"}


def classifier_head(weights: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """The head's tensors (`dense.*`, `out_proj.*`) taken out of an encoder's weights; ModelLoadError if absent."""
    if "classifier.out_proj.weight" not in weights and "classifier.weight" in weights:
        for hf, ours in _BERT_HEAD.items():
            for kind in ("weight", "bias"):
                if f"{hf}.{kind}" in weights:
                    weights[f"{ours}.{kind}"] = weights.pop(f"{hf}.{kind}")
    head = {k.removeprefix("classifier."): weights.pop(k) for k in list(weights) if k.startswith("classifier.")}
    if "out_proj.weight" not in head:
        raise ModelLoadError(f"{where}: a reranker needs a classification head (GGUF `cls.output` / "
                             "Hugging Face `classifier`); none found")
    return head


@dataclass
class LoadedCrossEncoder(LoadedEncoder):
    """A reranker ready to run: the encoder, its tokenizer and its classification head."""

    head: dict[str, torch.Tensor] = field(default_factory=dict)
    is_reranker: bool = True

    @property
    def output_dim(self) -> int:
        """How many logits the head gives per pair (1 for a relevance score)."""
        return int(self.head["out_proj.weight"].shape[0])

    def encode_pair(self, query: str, document: str) -> tuple[list[int], int]:
        """(ids of `[CLS] query [SEP] document [SEP]` cut to the model's limit (the document's end first, the last
        [SEP] kept), the untruncated token count)."""
        ids = self.tokenizer.encode(query, document, add_special_tokens=True).ids
        full, limit = len(ids), self.config.max_seq_length
        if full > limit:
            ids = ids[: limit - 1] + [ids[-1]]
        return ids, full

    def score_logits(self, states: torch.Tensor) -> torch.Tensor:
        """The head's logits [batch, output_dim] from encoder states [batch, seq, hidden] (the [CLS] row)."""
        h = self.head
        x = states[:, 0]
        if "dense.weight" in h:
            x = torch.tanh(F.linear(x, h["dense.weight"], h.get("dense.bias")))
        return F.linear(x, h["out_proj.weight"], h.get("out_proj.bias"))

    @torch.inference_mode()
    def embed(self, batch: list[list[int]]) -> torch.Tensor:
        """[len(batch), output_dim] float32 logits of pair sequences (from encode_pair)."""
        input_ids, mask = pad_batch(batch)
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        with self.threads(input_ids):
            states = self.states(input_ids, mask, segment_ids(input_ids, self.sep_id))
            return self.score_logits(states).float().cpu()


def is_cross_encoder_folder(path: Path) -> bool:
    """Whether a Hugging Face folder's config.json names a sequence classifier (a cross-encoder)."""
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return any(str(a).endswith("ForSequenceClassification") for a in cfg.get("architectures") or [])


def load_cross_encoder(source: Any, device: str = "cpu", dtype: str = "auto") -> LoadedCrossEncoder:
    """Load a BERT sequence classifier from a Hugging Face folder as a reranker."""
    from edgeserve.models.encoders.bert import load_encoder

    lm = load_encoder(source, device, dtype)
    head = classifier_head(lm.model.w, str(source.path))
    return LoadedCrossEncoder(lm.name, lm.source, lm.config, lm.model, lm.tokenizer, lm.cls_id, lm.sep_id,
                              lm.device, lm.load_seconds, head=head)
