"""The wheel maps kernels/, loaders/, offload/ into the edgeserve namespace and imports from an install."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_layout_and_import(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(ROOT)], check=True, capture_output=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("edgeserve-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for expected in ["edgeserve/kernels/formats/quant_linear.py", "edgeserve/loaders/gguf_file.py",
                     "edgeserve/offload/__init__.py", "edgeserve/models/llama.py", "edgeserve/cli.py",
                     "edgeserve/server/static/chat.html", "edgeserve/kernels/cpu/src/pool.c",
                     "edgeserve/kernels/cpu/include/pool.h", "edgeserve/kernels/cpu/src/attention.c"]:
        assert expected in names
    for f in (ROOT / "kernels/cpu").rglob("*.[ch]"):  # the native CPU kernels compile from these, subfolders too
        assert f"edgeserve/{f.relative_to(ROOT).as_posix()}" in names, f
    assert not any(n.split("/")[0] in ("kernels", "loaders", "offload", "tests") for n in names)
    for f in (ROOT / "edgeserve/server/static").rglob("*"):  # the chat page's files, vendored ones included
        assert not f.is_file() or f.relative_to(ROOT).as_posix() in names, f
    # every package in the source tree ships, under its edgeserve name
    for init in ROOT.glob("**/__init__.py"):
        rel = init.relative_to(ROOT).as_posix()
        top = rel.split("/")[0]
        if top in ("kernels", "loaders", "offload"):
            assert f"edgeserve/{rel}" in names, rel
        elif top == "edgeserve":
            assert rel in names, rel
    assert any(n.endswith("entry_points.txt") for n in names)

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    env = dict(os.environ, PYTHONPATH=str(site))
    code = ("import edgeserve, edgeserve.kernels.formats.quant_linear, edgeserve.loaders.gguf_file, edgeserve.offload;"
            "print(edgeserve.__file__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(site))


def test_editable_install_imports_namespace():
    import edgeserve.kernels
    import edgeserve.loaders
    import edgeserve.offload

    assert Path(edgeserve.kernels.__file__).parent == ROOT / "kernels"
    assert Path(edgeserve.loaders.__file__).parent == ROOT / "loaders"
    assert Path(edgeserve.offload.__file__).parent == ROOT / "offload"


def test_triton_only_where_it_is_used():
    """A CPU-only install does not carry triton (1 GB); the `triton` extra and the tests' extra bring it on Linux
    x86_64 (CUDA builds of torch bring their own)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.split(";")[0].strip().startswith("triton")]
    for extra in ("triton", "test"):
        found = [d for d in project["optional-dependencies"][extra] if d.startswith("triton")]
        assert found and "sys_platform == 'linux'" in found[0], extra
