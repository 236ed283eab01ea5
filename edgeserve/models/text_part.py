"""The language model's weights of a multimodal HF checkpoint (Mistral 3, Qwen3-VL) under the text model's names."""

from __future__ import annotations

from typing import Any

from edgeserve.loaders.weights import WeightSource, WeightValue

# transformers 5 saves a multimodal model's decoder under `model.language_model.` (older checkpoints:
# `language_model.model.`; Idefics3 / SmolVLM: `model.text_model.`), its output head as `lm_head` (older:
# `language_model.lm_head`)
_PREFIXES = (("model.", "model.language_model."), ("model.", "language_model.model."), ("model.", "model.text_model."),
             ("lm_head.", "language_model.lm_head."))


class RenamedWeights:
    """A WeightSource serving another source's tensors under the names edgeserve's models read: subclasses map a
    name to the source's in `_name`; expert blocks pass through under the mapped name."""

    def __init__(self, source: WeightSource):
        self.source = source

    def _name(self, name: str) -> str:
        return name

    def has(self, name: str) -> bool:
        return self.source.has(self._name(name))

    def get(self, name: str, keep_int4: bool) -> WeightValue:
        return self.source.get(self._name(name), keep_int4)

    @property
    def expert_bytes(self) -> int | None:
        return getattr(self.source, "expert_bytes", None)

    def expert_blocks(self, name: str):
        """A 3-D expert tensor's GGUF block bytes (None where the source has none)."""
        blocks = getattr(self.source, "expert_blocks", None)
        return None if blocks is None else blocks(self._name(name))


def language_model_prefix(source: WeightSource) -> str | None:
    """"model.language_model." where an HF source holds a multimodal checkpoint's decoder under that prefix (and
    not the text model's own names), else None (a GGUF, or a text-only checkpoint)."""
    if getattr(source, "gguf", None) is None and not source.has("model.embed_tokens.weight") \
            and source.has("model.language_model.embed_tokens.weight"):
        return "model.language_model."
    return None


class TextPartWeights(RenamedWeights):
    """A WeightSource that serves `model.X` / `lm_head.X` from a multimodal checkpoint's language model."""

    def _name(self, name: str) -> str:
        for ours, theirs in _PREFIXES:
            if name.startswith(ours) and self.source.has(theirs + name[len(ours):]):
                return theirs + name[len(ours):]
        return name

    def blocks(self, name: str) -> Any:
        blocks = getattr(self.source, "blocks", None)
        return None if blocks is None else blocks(self._name(name))

    def stored_quantized(self) -> list[str]:
        return self.source.stored_quantized()  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:  # expert_blocks, gguf, ... of the source
        return getattr(self.source, name)


def text_part(source: WeightSource) -> WeightSource:
    """`source` itself, or, where its decoder sits under a multimodal model's language-model prefix, a view of it
    under the text model's names."""
    if source.has("model.embed_tokens.weight"):
        return source
    if any(source.has(theirs + "embed_tokens.weight") for ours, theirs in _PREFIXES if ours == "model."):
        return TextPartWeights(source)
    return source
