"""What Ollama's /api/show, /api/tags and /api/ps say about a model, read from its file without loading it.

Format, family, parameter count (from the tensor shapes), quantization level (the GGUF file type, or the
safetensors dtype), the architecture keys (`model_info`), chat template, stop tokens, license, capabilities
and the sha256 digest of the weights. Facts are cached per file (path, size, mtime) in memory; digests also
on disk, so a file is hashed once per machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any

from edgeserve.registry import CATALOG, ModelSource, resolve
from edgeserve.registry.paths import write_text_atomic
from edgeserve.server.recommended_sampling import from_gguf, from_generation_config, ollama_lines

_CHUNK = 1 << 20
_SAFETENSORS_QUANT = {"F32": "F32", "F16": "F16", "BF16": "BF16", "I8": "Q8_0", "U8": "Q8_0"}
ENCODER_TYPES = {"bert", "roberta", "xlm-roberta", "distilbert", "nomic_bert", "mpnet"}


@dataclass
class ModelFacts:
    """Everything /api/show and /api/tags report about one model on disk."""

    format: str
    family: str
    parameter_count: int
    quantization_level: str
    size: int
    model_info: dict[str, Any] = field(default_factory=dict)
    template: str = ""
    stop: list[str] = field(default_factory=list)
    license: str = ""
    capabilities: list[str] = field(default_factory=lambda: ["completion"])
    context_length: int = 0
    sampling: dict[str, Any] = field(default_factory=dict)  # recommended sampling (server/recommended_sampling.py)

    @property
    def parameter_size(self) -> str:
        """Ollama's spelling of the parameter count: '135M', '1.5B'."""
        return format_parameter_size(self.parameter_count)

    def details(self) -> dict[str, Any]:
        """Ollama's `details` object."""
        return {"parent_model": "", "format": self.format, "family": self.family, "families": [self.family],
                "parameter_size": self.parameter_size, "quantization_level": self.quantization_level}

    def parameters(self) -> str:
        """Ollama's `parameters` text (one `name value` per line)."""
        lines = [f"stop {json.dumps(s)}" for s in self.stop]
        if self.context_length:
            lines.append(f"num_ctx {self.context_length}")
        return "\n".join(lines + ollama_lines(self.sampling))


def capabilities(template: str, kind: str | None = None, tool_use: str = "") -> list[str]:
    """Ollama's capabilities: "completion" for a text model, with "tools" when its chat template renders tools
    (as the chat route decides to hand them to the template), or it has a named `tool_use` template, and
    "thinking" when it reasons (<think> tags, its format's own, harmony); `kind` "embedding" (a model that embeds)
    or "rerank" (a reranker) instead of those (see models/encoders/embedders.py)."""
    from edgeserve.text.harmony import template_is_harmony
    from edgeserve.text.reasoning import template_thinks
    from edgeserve.text.tool_calls import template_knows_tools

    if kind is not None:
        return [kind]
    caps = ["completion"]
    if (template and template_knows_tools(template)) or tool_use:
        caps.append("tools")
    if template and (template_thinks(template) or template_is_harmony(template)):
        caps.append("thinking")
    return caps


def spec_facts(spec: str, source: ModelSource | None = None) -> ModelFacts | None:
    """The facts of the model `spec` names (its resolved `source` when given); None when its file cannot be read
    (not pulled, missing, unreadable)."""
    try:
        src = source or resolve(spec, pull_missing=False)
        return model_facts(src, CATALOG[spec].license if spec in CATALOG else "")
    except Exception:  # noqa: BLE001 - any unreadable model is reported without facts
        return None


def format_parameter_size(n: int) -> str:
    """'135M', '1.5B', '7B' (as Ollama prints it)."""
    if n >= 1e9:
        return f"{n / 1e9:.1f}B".replace(".0B", "B")
    if n >= 1e6:
        return f"{n / 1e6:.0f}M"
    return f"{n / 1e3:.0f}K"


_lock = threading.Lock()
_facts: dict[tuple, ModelFacts] = {}
_digests: dict[tuple, str] = {}


def _stamp(path: Path) -> tuple:
    st = path.stat()
    return (str(path), st.st_size, st.st_mtime_ns)


def weights_files(source: ModelSource) -> list[Path]:
    """The files that hold the weights: the GGUF file, or the folder's *.safetensors files (sorted)."""
    if source.kind == "gguf":
        return [source.path]
    return sorted(source.path.glob("*.safetensors"))


def model_facts(source: ModelSource, license: str = "") -> ModelFacts:
    """The facts of `source` (cached per file version); reads only file headers."""
    files = weights_files(source)
    key = tuple(_stamp(p) for p in files) or (str(source.path),)
    with _lock:
        if key in _facts:
            return _facts[key]
    facts = _gguf_facts(source.path) if source.kind == "gguf" else _hf_facts(source.path, files)
    facts.license = facts.license or license
    with _lock:
        _facts[key] = facts
    return facts


def digest(source: ModelSource, known_sha256: str = "") -> str:
    """'sha256:<hex>' of the weights file (the first safetensors file of a folder).

    A file is hashed once per machine: digests are kept by (path, size, mtime) in memory and in
    `<edgeserve home>/digests.json`, so a big model's first /api/tags is the only slow one.
    """
    if known_sha256:
        return f"sha256:{known_sha256}"
    files = weights_files(source)
    if not files:
        return ""
    key = _stamp(files[0])
    with _lock:
        if not _digests:
            _digests.update(_load_digest_file())
        if key in _digests:
            return _digests[key]
    h = hashlib.sha256()
    with open(files[0], "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    value = f"sha256:{h.hexdigest()}"
    with _lock:
        _digests[key] = value
        _save_digest_file(_digests)
    return value


def _digest_file() -> Path:
    from edgeserve.registry import edgeserve_home

    return edgeserve_home() / "digests.json"


def _load_digest_file() -> dict[tuple, str]:
    try:
        rows = json.loads(_digest_file().read_text())
        return {(r["path"], r["size"], r["mtime_ns"]): r["digest"] for r in rows}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _save_digest_file(digests: dict[tuple, str]) -> None:
    rows = [{"path": k[0], "size": k[1], "mtime_ns": k[2], "digest": v} for k, v in digests.items()
            if os.path.exists(k[0])]  # files gone (deleted models, test files) drop out
    path = _digest_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(rows))
    except OSError:  # a read-only home only costs re-hashing in the next process
        pass


def _gguf_facts(path: Path) -> ModelFacts:
    from edgeserve.vision.runtime import find_mmproj
    from gguf.constants import LlamaFileType

    from edgeserve.loaders.gguf_file import GGUFFile

    g = GGUFFile(path)
    md = g.metadata
    arch = str(md.get("general.architecture", "llama"))
    params = sum(prod(g.tensor_info(n).shape) for n in g.tensor_names())
    ftype = md.get("general.file_type")
    try:
        quant = LlamaFileType(int(ftype)).name.replace("MOSTLY_", "").replace("ALL_", "")
    except (TypeError, ValueError):
        quant = _dominant_qtype(g)
    info = {k: v for k, v in md.items()
            if not k.startswith("tokenizer.") and isinstance(v, (int, float, str, bool)) and k != "general.file_type"}
    info["general.parameter_count"] = params
    info["general.file_type"] = ftype
    tokens = md.get("tokenizer.ggml.tokens") or []
    info["tokenizer.ggml.model"] = md.get("tokenizer.ggml.model", "")
    stop = []
    for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        i = md.get(k)
        if isinstance(i, int) and 0 <= i < len(tokens) and tokens[i] not in stop:
            stop.append(tokens[i])
    from edgeserve.models.encoders.embedders import gguf_kind

    template = str(md.get("tokenizer.chat_template") or "")
    tool_use = str(md.get("tokenizer.chat_template.tool_use") or "")
    caps = capabilities(template, gguf_kind(md, g.tensor_names()), tool_use)  # an embedder or reranker is served by the embedder only
    if find_mmproj(path) is not None:  # a projector beside it (an hf.co pull's): it takes images
        caps.append("vision")
    ctx = int(md.get(f"{arch}.context_length") or 0)
    return ModelFacts("gguf", arch, params, quant, path.stat().st_size, info, template, stop,
                      str(md.get("general.license") or ""), caps, ctx, from_gguf(md))


def _dominant_qtype(g: Any) -> str:
    counts: dict[str, int] = {}
    for n in g.tensor_names():
        info = g.tensor_info(n)
        counts[info.qtype] = counts.get(info.qtype, 0) + prod(info.shape)
    return max(counts, key=counts.__getitem__) if counts else ""


def safetensors_shapes(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} from a .safetensors header (the data is not read)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"}


_HF_KEYS = {  # config.json key -> GGUF-style model_info suffix
    "max_position_embeddings": "context_length", "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length", "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon", "layer_norm_eps": "attention.layer_norm_epsilon",
    "rope_theta": "rope.freq_base", "vocab_size": "vocab_size",
}


def _hf_facts(folder: Path, files: list[Path]) -> ModelFacts:
    from edgeserve.vision.family import has_vision

    cfg = _json(folder / "config.json") if folder.is_dir() else _json(folder)
    arch = str(cfg.get("model_type") or "llama")
    params, dtypes = 0, {}
    for f in files:
        for dtype, shape in safetensors_shapes(f).values():
            params += prod(shape)
            dtypes[dtype] = dtypes.get(dtype, 0) + prod(shape)
    qc = cfg.get("quantization_config") or {}
    if qc.get("bits"):
        quant = f"{str(qc.get('quant_method', 'int')).upper()}_{qc['bits']}BIT"
    else:
        top = max(dtypes, key=dtypes.__getitem__) if dtypes else str(cfg.get("torch_dtype", "")).upper()
        quant = _SAFETENSORS_QUANT.get(top, top)
    info: dict[str, Any] = {"general.architecture": arch, "general.parameter_count": params}
    for k, suffix in _HF_KEYS.items():
        if isinstance(cfg.get(k), (int, float)):
            info[f"{arch}.{suffix}"] = cfg[k]
    tok_cfg = _json(folder / "tokenizer_config.json") if folder.is_dir() else {}
    template = tok_cfg.get("chat_template") or ""
    tool_use = ""
    if not isinstance(template, str):  # a list of named templates
        named = {t.get("name"): t.get("template") or "" for t in template if isinstance(t, dict)}
        template, tool_use = named.get("default", ""), named.get("tool_use", "")
    eos = tok_cfg.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    from edgeserve.models.encoders.embedders import folder_kind

    kind = folder_kind(folder) if folder.is_dir() else None
    if kind is None and (arch in ENCODER_TYPES or (folder.is_dir() and (folder / "modules.json").is_file())):
        kind = "embedding"  # an encoder or sentence-transformers folder edgeserve may not load: still not a chat model
    caps = capabilities(template, kind, tool_use)
    if folder.is_dir() and has_vision(folder):
        caps.append("vision")
    size = sum(f.stat().st_size for f in files)
    return ModelFacts("safetensors", arch, params, quant, size, info, template, [eos] if eos else [], "", caps,
                      int(cfg.get("max_position_embeddings") or 0),
                      from_generation_config(folder) if folder.is_dir() else {})


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
