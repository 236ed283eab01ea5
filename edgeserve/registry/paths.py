"""Where edgeserve keeps its files: the home folder and the pulled models."""

from __future__ import annotations

import os
from pathlib import Path


def edgeserve_home() -> Path:
    """The edgeserve folder: $EDGESERVE_HOME, else $XDG_CACHE_HOME/edgeserve, else ~/.cache/edgeserve."""
    home = os.environ.get("EDGESERVE_HOME")
    if home:
        return Path(home).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    # The XDG spec says relative values are invalid and must be ignored.
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "edgeserve"
    return Path.home() / ".cache" / "edgeserve"


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` so that a concurrent reader sees the old file or the whole new one, never a part (a
    temporary file beside it, then a rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def models_dir() -> Path:
    """The folder that holds pulled catalog models (not created here)."""
    return edgeserve_home() / "models"
