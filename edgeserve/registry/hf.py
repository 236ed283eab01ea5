"""Models pulled from Hugging Face through huggingface_hub: `hf.co/OWNER/REPO[:QUANT]` (one GGUF file of a repo)
and `OWNER/REPO` (a safetensors repo: config, tokenizer, weights).

Files go to `models_dir()/hf/OWNER/REPO/` (huggingface_hub's `local_dir` mode: resumable, honours `HF_ENDPOINT`,
`HF_TOKEN` and `HF_HUB_OFFLINE`) and are checked against the sha256 (LFS files) or git blob id (small files) the
Hub lists; a pulled model is found again without the network.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from edgeserve.errors import ModelLoadError, PullError
from edgeserve.registry.paths import models_dir

DEFAULT_QUANT = "Q4_K_M"
_GGUF_PREFIXES = ("hf.co/", "huggingface.co/", "https://huggingface.co/")
_REPO_RE = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# quantization names as they appear in GGUF file names, longest first so Q4_K_M wins over Q4_K
_QUANT_RE = re.compile(r"(?<![A-Za-z0-9])(IQ\d_[A-Z]+|Q\d_K_[SML]|Q\d_K|Q\d_\d|TQ\d_\d|BF16|F16|F32)(?![A-Za-z0-9])",
                       re.IGNORECASE)
# what a safetensors pull fetches
_FOLDER_PATTERNS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "tokenizer.model", "chat_template.jinja", "*.safetensors",
                    "model.safetensors.index.json")
_COMPLETE = ".edgeserve-complete"
# llama.cpp's gguf-split part names: NAME-00001-of-00003.gguf
_SPLIT_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


@dataclass(frozen=True)
class HFRef:
    """A parsed Hugging Face model name."""

    repo: str  # OWNER/REPO
    gguf: bool  # hf.co/... names a GGUF file; a bare OWNER/REPO a safetensors repo
    quant: str | None = None  # the `:QUANT` of a GGUF name, upper-cased

    @property
    def name(self) -> str:
        """The canonical spelling."""
        if not self.gguf:
            return self.repo
        return f"hf.co/{self.repo}" + (f":{self.quant}" if self.quant else "")

    @property
    def folder(self) -> Path:
        """Where this repo's files are kept."""
        return models_dir() / "hf" / self.repo


def parse(name: str) -> HFRef | None:
    """The HFRef for `hf.co/OWNER/REPO[:QUANT]`, `OWNER/REPO` or a short name of the HF catalog, else None
    (a PyPI catalog name, a path, ...)."""
    from edgeserve.registry.catalog import HF_CATALOG

    if not isinstance(name, str):
        return None
    if name in HF_CATALOG:
        name = HF_CATALOG[name].hf
    for prefix in _GGUF_PREFIXES:
        if name.lower().startswith(prefix):
            rest = name[len(prefix):]
            repo, _, quant = rest.partition(":")
            if not _REPO_RE.fullmatch(repo):
                return None
            quant = quant.upper() or None
            return HFRef(repo, True, None if quant == "LATEST" else quant)
    if _REPO_RE.fullmatch(name) and not name.lower().endswith((".gguf", ".json")) and not Path(name).exists():
        return HFRef(name, False)
    return None


def is_hf_name(name: str) -> bool:
    """Whether `name` is a Hugging Face model name (not a catalog name or a local path)."""
    return parse(name) is not None


def quant_of(filename: str) -> str | None:
    """The quantization a GGUF file name carries (e.g. "Q4_K_M"), upper-cased, or None."""
    found = _QUANT_RE.findall(Path(filename).name)
    return found[-1].upper() if found else None


def split_parts(first: str) -> list[str]:
    """All part names of a split GGUF model given its first part's (`NAME-00001-of-00003.gguf`); [first] for a
    single file."""
    from edgeserve.loaders.gguf_file import gguf_parts

    return [str(p) for p in gguf_parts(first)]


def pick_gguf(files: dict[str, int], quant: str | None) -> str:
    """The GGUF model to pull from a repo's {file: size}: the one carrying `quant`; without one, Q4_K_M, else the
    smallest 4-bit one. A split model (`-00001-of-00003`) counts as one, named by its first part, sized by all of
    them. PullError lists the models otherwise."""
    ggufs: dict[str, int] = {}
    for f, size in files.items():
        if not f.lower().endswith(".gguf") or is_mmproj(f):
            continue
        m = _SPLIT_RE.search(f)
        if m is None:
            ggufs[f] = size
        elif int(m[1]) == 1:
            ggufs[f] = sum(files.get(p, 0) for p in split_parts(f))
    if not ggufs:
        raise PullError(f"the repository has no GGUF models (files: {', '.join(sorted(files)) or 'none'})")
    want = [quant] if quant else [DEFAULT_QUANT]
    for q in want:
        hits = sorted((s, f) for f, s in ggufs.items() if quant_of(f) == q)
        if hits:
            return hits[0][1]
    if quant is None:
        four_bit = sorted((s, f) for f, s in ggufs.items() if (quant_of(f) or "").lstrip("I").startswith("Q4"))
        if four_bit:
            return four_bit[0][1]
    listing = ", ".join(f"{f} ({quant_of(f) or '?'})" for f in sorted(ggufs))
    raise PullError(f"no GGUF file for {quant or 'a 4-bit quantization'}; the repository has: {listing}")


def is_mmproj(filename: str) -> bool:
    """Whether a repository file is a vision projector (llama.cpp's `mmproj-*.gguf`), not a model."""
    name = filename.rsplit("/", 1)[-1].lower()
    return "mmproj" in name and name.endswith(".gguf")


def pick_mmproj(files: dict[str, int], model: str) -> str | None:
    """The vision projector to pull beside `model` (as llama-server's -hf does): in its folder, F16 first, then BF16,
    Q8_0, F32, else the smallest; None when the repository has none."""
    folder = model.rsplit("/", 1)[0] if "/" in model else ""
    found = [f for f in files if is_mmproj(f) and (f.rsplit("/", 1)[0] if "/" in f else "") == folder]
    for q in ("F16", "BF16", "Q8_0", "F32"):
        hits = sorted(f for f in found if quant_of(f) == q)
        if hits:
            return hits[0]
    return min(found, key=lambda f: (files[f], f)) if found else None


def local_path(name: str) -> Path | None:
    """The pulled and verified file (GGUF) or folder (safetensors) for an HF name, or None."""
    ref = parse(name)
    if ref is None or not ref.folder.is_dir():
        return None
    if not ref.gguf:
        return ref.folder if (ref.folder / _COMPLETE).is_file() else None
    verified = [str(p.relative_to(ref.folder))[: -len(".verified")] for p in ref.folder.rglob("*.gguf.verified")]
    files = {f: (ref.folder / f).stat().st_size for f in verified
             if all((ref.folder / p).is_file() for p in split_parts(f))}
    try:
        return ref.folder / pick_gguf(files, ref.quant) if files else None
    except PullError:
        return None


def pull_hf(name: str, progress: bool = True, out: TextIO = sys.stderr) -> Path:
    """Pull an HF model (see the module docstring) unless it is there already; return its file or folder."""
    ref = parse(name)
    if ref is None:
        raise PullError(f"{name!r} is not a Hugging Face model name (hf.co/OWNER/REPO[:QUANT] or OWNER/REPO)")
    found = local_path(name)
    if found is not None:
        return found
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    endpoint = os.environ.get("HF_ENDPOINT") or None
    api = HfApi(endpoint=endpoint)
    try:
        info = api.model_info(ref.repo, files_metadata=True)
    except OfflineModeIsEnabled:
        raise PullError(f"{ref.name} is not pulled and HF_HUB_OFFLINE is set") from None
    except HfHubHTTPError as e:
        raise PullError(f"cannot list {ref.repo} on the Hub: {_short(e)}") from None
    except Exception as e:  # connection errors come as httpx's, OSError or others depending on the transport
        raise PullError(f"cannot reach the Hub for {ref.repo}: {_short(e)}") from None
    siblings = {s.rfilename: s for s in info.siblings or []}
    if ref.gguf:
        sizes = {f: s.size or 0 for f, s in siblings.items()}
        wanted = split_parts(pick_gguf(sizes, ref.quant))
        missing = [f for f in wanted if f not in siblings]
        if missing:
            raise PullError(f"{ref.repo} lacks part {', '.join(missing)} of the split model {wanted[0]}")
        mmproj = pick_mmproj(sizes, wanted[0])  # a vision model's projector comes along (found beside it)
        wanted += [mmproj] if mmproj is not None and not (ref.folder / mmproj).is_file() else []
    else:
        from fnmatch import fnmatch

        wanted = sorted(f for f in siblings if "/" not in f and any(fnmatch(f, p) for p in _FOLDER_PATTERNS))
        if "config.json" not in wanted or not any(f.endswith(".safetensors") for f in wanted):
            raise PullError(f"{ref.repo} is not a safetensors model repository (no config.json and *.safetensors; "
                            f"for a GGUF repository use hf.co/{ref.repo})")
    ref.folder.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"pulling {ref.name}: {', '.join(wanted)}", file=out, flush=True)
    for filename in wanted:
        try:
            path = Path(hf_hub_download(ref.repo, filename, revision=info.sha, local_dir=ref.folder,
                                        endpoint=endpoint, tqdm_class=_bar_class(progress, out)))
        except Exception as e:  # HTTP errors, dropped connections past the retries, a full disk
            raise PullError(f"downloading {filename} from {ref.repo} failed: {_short(e)}") from None
        _verify(path, siblings[filename])
    if ref.gguf:
        dest = ref.folder / wanted[0]
        _sidecar(dest).write_text(json.dumps({"size": dest.stat().st_size}))
    else:
        dest = ref.folder
        (dest / _COMPLETE).write_text(json.dumps({"sha": info.sha, "files": wanted}))
    if progress:
        print(f"pulled {ref.name} -> {dest} (checksums ok)", file=out, flush=True)
    return dest


def remove(name: str) -> list[Path]:
    """Delete a pulled HF model (a GGUF file of a repo, or a safetensors folder); returns what was removed."""
    ref = parse(name)
    found = local_path(name) if ref else None
    if ref is None or found is None:
        raise ModelLoadError(f"{name!r} is not pulled")
    if found.is_dir():
        shutil.rmtree(found)
        removed = [found]
    else:
        removed = [found.parent / p for p in split_parts(found.name)]
        for path in removed:
            path.unlink(missing_ok=True)
        _sidecar(found).unlink(missing_ok=True)
        if not any(ref.folder.rglob("*.gguf")):
            shutil.rmtree(ref.folder)  # also huggingface_hub's metadata and any partial downloads
    owner = ref.folder.parent
    if owner.is_dir() and not any(owner.iterdir()):
        owner.rmdir()
    return removed


def list_pulled() -> list[tuple[str, Path]]:
    """(name, path) of every pulled HF model."""
    root = models_dir() / "hf"
    out: list[tuple[str, Path]] = []
    for folder in sorted(p for p in root.glob("*/*") if p.is_dir()):
        repo = f"{folder.parent.name}/{folder.name}"
        if (folder / _COMPLETE).is_file():
            out.append((repo, folder))
        for side in sorted(folder.rglob("*.gguf.verified")):
            gguf = side.with_name(side.name[: -len(".verified")])
            if gguf.is_file():
                quant = quant_of(gguf.name)
                out.append((f"hf.co/{repo}" + (f":{quant}" if quant else ""), gguf))
    return out


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _verify(path: Path, sibling) -> None:
    """Check a downloaded file against the Hub's sha256 (LFS) or git blob id; delete it and raise if it differs."""
    lfs = getattr(sibling, "lfs", None)
    expected = (lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)) if lfs else None
    size = path.stat().st_size
    if expected:
        digest = hashlib.sha256()
    else:
        expected = getattr(sibling, "blob_id", None)
        if not expected:
            return
        digest = hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        path.unlink()
        raise PullError(f"checksum mismatch for {path.name}: got {digest.hexdigest()}, the Hub lists {expected}; "
                        "the file was deleted")


def _short(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _bar_class(progress: bool, out: TextIO):
    """A tqdm class for huggingface_hub's download bars: drawn on `out`, or not at all."""
    from tqdm.auto import tqdm

    class Bar(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs) -> None:
            kwargs.update(file=out, disable=not progress, mininterval=0.5)
            kwargs.pop("name", None)
            super().__init__(*args, **kwargs)

    return Bar
