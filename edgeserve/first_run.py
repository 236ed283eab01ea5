"""The first-run hint: the default model is a 135M model for trying edgeserve out and for tests, so the first
`edgeserve run` on it says which catalog model to pull for real use (once per cache folder)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from edgeserve.registry.catalog import DEFAULT_MODEL
from edgeserve.registry.paths import edgeserve_home

RECOMMENDED_MODEL = "qwen2.5-1.5b"  # HF catalog: 1.1 GB, answers sensibly on a laptop CPU

HINT = (f"note: {DEFAULT_MODEL}, the default model, is a 135M model for trying edgeserve out and for tests; its "
        f"answers are often nonsense. For real use: edgeserve pull {RECOMMENDED_MODEL} && edgeserve run "
        f"{RECOMMENDED_MODEL} (edgeserve list --all lists the catalog)")


def _marker() -> Path:
    """The file whose presence says the hint was shown."""
    return edgeserve_home() / ".first-run-hint-shown"


def first_run_hint(model: str, out: TextIO | None = None) -> bool:
    """Print HINT to `out` (default: stderr) if `model` is the default model and the hint was never shown from this
    cache folder; whether it was printed."""
    if model != DEFAULT_MODEL:
        return False
    marker = _marker()
    if marker.exists():
        return False
    print(HINT, file=out or sys.stderr, flush=True)
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:  # a read-only cache folder: the hint shows again next time, nothing worse
        pass
    return True
