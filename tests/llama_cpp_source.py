"""llama.cpp's own source as test data: its converter, tokenizer vectors, chat templates and chat-parser tests.

The reference files come from the `llama-cpp-python` sdist on PyPI (its `vendor/llama.cpp`), fetched once with
`pip download` into the user cache folder (`<edgeserve home>/reference/`), like the test models. Only the parts the
tests read are unpacked: `convert_hf_to_gguf.py` with its `conversion/` package and `gguf-py/`, `models/`
(`ggml-vocab-*.gguf` with `.inp` / `.out`, `templates/*.jinja`) and `tests/test-chat.cpp`.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"
VENDOR = "vendor/llama.cpp/"
KEEP = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/", "tests/test-chat.cpp", "LICENSE")


def _unpack(archive: Path, dest: Path) -> None:
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            _, _, rel = member.name.partition("/")  # drop the sdist's top folder
            if not rel.startswith(VENDOR):
                continue
            rel = rel[len(VENDOR):]
            if not rel.startswith(KEEP) or not (member.isfile() or member.isdir()):
                continue
            member.name = rel
            tar.extract(member, dest, filter="data")


def llama_cpp_dir() -> Path:
    """The unpacked reference folder (llama.cpp's source tree, the parts listed in KEEP), fetched once."""
    from edgeserve.registry.paths import edgeserve_home

    root = edgeserve_home() / "reference"
    dest = root / ("llama.cpp-" + SDIST.split("==")[1])
    if (dest / ".complete").exists():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # pytest-xdist workers or two test runs share one fetch
        if (dest / ".complete").exists():
            return dest
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                            SDIST, "-d", tmp], check=True)
            (archive,) = Path(tmp).glob("*.tar.gz")
            staged = Path(tmp) / "unpacked"
            _unpack(archive, staged)
            shutil.rmtree(dest, ignore_errors=True)
            staged.rename(dest)
        (dest / ".complete").touch()
    return dest
