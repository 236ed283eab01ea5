"""The architecture registry: every decoder architecture edgeserve runs, by the names files give it, and the package
that knows it (imported on first use).

A name here is ours and, for a GGUF, llama.cpp's `general.architecture`; an HF config names the same architecture
by its `model_type` (or, without one, by `architectures[0]`, a class name). Each package under
`edgeserve.models.archs` holds one family: in `__init__.py` its declarations (GGUF tensor names beyond the Llama
ones, flags), in `config.py` its config reader (its own fields on top of the shared ones config.py reads), in
`model.py` which decoder runs it (that class holds the native plan hook, `native_decoder`). Adding an architecture
is one folder there and one `Architecture(...)` line below (docs/MODELS.md, "Adding an architecture").
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from edgeserve.errors import UnsupportedModelError


@dataclass(frozen=True)
class Architecture:
    """One architecture: our (and llama.cpp's) name, the package under `edgeserve.models.archs` that runs it, the HF
    `model_type`s and class names that mean it, and GGUF architecture names read as it (their keys renamed)."""

    name: str
    package: str
    hf_model_types: tuple[str, ...] = ()
    hf_classes: tuple[str, ...] = ()
    gguf_aliases: tuple[str, ...] = ()

    def part(self, module: str = "") -> ModuleType:
        """The package (`module` ""), or one of its modules ("config", "model"), imported now."""
        path = f"edgeserve.models.archs.{self.package}" + (f".{module}" if module else "")
        return importlib.import_module(path)

    def declared(self, name: str, default: Any = None) -> Any:
        """A declaration of the package's `__init__` (a tensor-name table, a flag), or `default`. A flag is a bool
        for every name the package runs, or the tuple of the names it holds for."""
        value = getattr(self.part(), name, default)
        return self.name in value if isinstance(value, tuple) else value

    def config_hook(self, name: str) -> Any:
        """A function or flag of the package's config reader, or None where it has none."""
        return getattr(self.part("config"), name, None)


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("llama", "llama", ("llama",), ("LlamaForCausalLM",)),
    Architecture("mistral", "llama", ("mistral",), ("MistralForCausalLM",)),
    Architecture("smollm3", "llama", ("smollm3",), ("SmolLM3ForCausalLM",)),
    Architecture("mistral3", "llama", ("mistral3", "ministral3"),
                 ("Ministral3ForCausalLM", "Mistral3ForConditionalGeneration")),
    Architecture("granite", "llama", ("granite",), ("GraniteForCausalLM",)),
    Architecture("qwen2", "qwen", ("qwen2",), ("Qwen2ForCausalLM",)),
    Architecture("qwen3", "qwen", ("qwen3",), ("Qwen3ForCausalLM",)),
    Architecture("qwen2vl", "qwen", ("qwen2vl", "qwen2_5_vl", "qwen2_5_vl_text", "qwen2_vl", "qwen2_vl_text"),
                 ("Qwen2_5_VLForConditionalGeneration", "Qwen2VLForConditionalGeneration")),
    Architecture("qwen3vl", "qwen", ("qwen3vl", "qwen3_vl", "qwen3_vl_text"), ("Qwen3VLForConditionalGeneration",)),
    Architecture("qwen3moe", "qwen3moe", ("qwen3moe", "qwen3_moe"), ("Qwen3MoeForCausalLM",)),
    Architecture("gemma2", "gemma", ("gemma2",), ("Gemma2ForCausalLM",)),
    Architecture("gemma3", "gemma", ("gemma3", "gemma3_text"), ("Gemma3ForCausalLM",),
                 gguf_aliases=("gemma-embedding",)),  # EmbeddingGemma: a Gemma 3 body (decoder_embed: bidirectional)
    Architecture("gemma4", "gemma4", ("gemma4", "gemma4_text"),
                 ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")),
    Architecture("gemma4_unified", "gemma4_unified", ("gemma4_unified", "gemma4_unified_text"),
                 ("Gemma4UnifiedForConditionalGeneration", "Gemma4UnifiedForCausalLM")),
    # a drafter over a Gemma 4 target's K/V (--draft only; engine.spec.assistant)
    Architecture("gemma4-assistant", "gemma4_assistant", ("gemma4_assistant", "gemma4_unified_assistant"),
                 ("Gemma4AssistantForCausalLM", "Gemma4UnifiedAssistantForCausalLM")),
    Architecture("phi3", "phi3", ("phi3",), ("Phi3ForCausalLM",)),
    Architecture("gpt-oss", "gpt_oss", ("gpt-oss", "gpt_oss"), ("GptOssForCausalLM",)),
    Architecture("olmo2", "olmo2", ("olmo2", "olmo3"), ("Olmo2ForCausalLM", "Olmo3ForCausalLM")),
    Architecture("qwen35", "qwen35", ("qwen35", "qwen3_5", "qwen3_5_text"),
                 ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")),
    Architecture("qwen35moe", "qwen35", ("qwen35moe", "qwen3_5_moe", "qwen3_5_moe_text"),
                 ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")),
    Architecture("lfm2", "lfm2", ("lfm2",), ("Lfm2ForCausalLM", "LFM2ForCausalLM")),
    Architecture("lfm2moe", "lfm2", ("lfm2_moe", "lfm2moe"), ("Lfm2MoeForCausalLM",)),
    Architecture("lfm3", "lfm3", ("lfm3",), ("Lfm3ForCausalLM",)),  # GGUF: ours, pending llama.cpp (archs/lfm3)
    Architecture("nemotron_h", "nemotron_h", ("nemotron_h",), ("NemotronHForCausalLM",)),
    # HF names both `nemotron_h` (its config reader names the MoE one); a nemotron_h_moe GGUF without experts is dense
    Architecture("nemotron_h_moe", "nemotron_h"),
    Architecture("granitehybrid", "granitehybrid", ("granitemoehybrid",), ("GraniteMoeHybridForCausalLM",)),
    Architecture("falcon-h1", "falcon_h1", ("falcon_h1",), ("FalconH1ForCausalLM",)),
)
# HF model types that wrap another architecture's text model in `text_config` (SmolVLM: a Llama inside)
HF_WRAPPERS = ("idefics3", "smolvlm")

_BY_NAME = {a.name: a for a in ARCHITECTURES}
_BY_GGUF = {alias: a for a in ARCHITECTURES for alias in (a.name, *a.gguf_aliases)}
_BY_HF_TYPE = {t: a for a in ARCHITECTURES for t in a.hf_model_types}
_BY_HF_CLASS = {c: a for a in ARCHITECTURES for c in a.hf_classes}


def names() -> tuple[str, ...]:
    """Every registered architecture's name."""
    return tuple(_BY_NAME)


def architecture(name: str) -> Architecture:
    """The registered architecture `name` (ours), else refused by name."""
    arch = _BY_NAME.get(name)
    if arch is None:
        raise UnsupportedModelError(f"architecture {name!r} is not supported (supported: {', '.join(names())})")
    return arch


def gguf_architecture(gguf_name: str) -> Architecture:
    """The architecture a GGUF's `general.architecture` names (an alias included), else refused by name."""
    arch = _BY_GGUF.get(gguf_name)
    return arch if arch is not None else architecture(gguf_name)


def find_gguf_architecture(gguf_name: str) -> Architecture | None:
    """The architecture a GGUF's `general.architecture` names (an alias included), or None (an encoder's, a
    vision tower's)."""
    return _BY_GGUF.get(gguf_name)


def hf_model_type(model_type: str) -> str:
    """Our architecture name for an HF `model_type` (unknown ones as they are, for the caller to refuse)."""
    arch = _BY_HF_TYPE.get(model_type)
    return arch.name if arch is not None else model_type


def hf_class(class_name: str) -> str:
    """Our architecture name for an HF `architectures[0]` class name (unknown ones as they are)."""
    arch = _BY_HF_CLASS.get(class_name)
    return arch.name if arch is not None else class_name


def names_declaring(flag: str) -> tuple[str, ...]:
    """The architectures whose package declares `flag` true (imports every package's `__init__`)."""
    return tuple(a.name for a in ARCHITECTURES if a.declared(flag, False))
