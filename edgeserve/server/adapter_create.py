"""Ollama's `/api/create` for adapter models: a new name that runs a LoRA adapter on a base model (`from`), the
adapter's files named by blob digest (pushed with `/api/blobs`, as Ollama's clients do) or, as an edgeserve
extension, by a local path. The name then lists in /api/tags and /v1/models and serves the adapter until the server
stops, like an adapter loaded with /v1/load_lora_adapter. Anything else /api/create can do (files, quantize,
template, ...) is refused by field name."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

from edgeserve.registry.catalog import CATALOG
from edgeserve.server.adapters import load_adapter
from edgeserve.server.blobs import blob_folder, blob_path
from edgeserve.server.errors import bad_request
from edgeserve.server.model_manager import ModelManager

NOT_SUPPORTED = ("files", "quantize", "template", "system", "parameters", "messages", "license", "modelfile", "path")
KNOWN = {"model", "name", "from", "adapters", "stream", *NOT_SUPPORTED}


async def create_adapter_model(manager: ModelManager, body: dict[str, Any]) -> str:
    """Make `body["model"]` run `body["adapters"]` on `body["from"]` (checked now: a bad adapter is a 400);
    returns the name."""
    for key in body:
        if key not in KNOWN:
            raise bad_request(f"unknown field {key!r} for /api/create", key)
        if key in NOT_SUPPORTED and body[key] not in (None, "", {}, []):
            raise bad_request(f"/api/create here makes adapter models only (`from` + `adapters`); {key!r} is not "
                              "supported", key)
    name = body.get("model") or body.get("name")
    if isinstance(name, str) and name.endswith(":latest"):
        name = name[: -len(":latest")]
    if not isinstance(name, str) or not name or ":" in name or "/" in name:
        raise bad_request("model must be the new model's name, without ':' (other than ':latest') or '/'", "model")
    base = body.get("from")
    if not isinstance(base, str) or not base:
        raise bad_request("from must name the base model the adapter runs on", "from")
    try:
        base_id, _ = manager.canonical(base)
    except Exception:  # noqa: BLE001 - any unknown or malformed name
        raise bad_request(f"from {base!r} is not a model this server has (GET /api/tags lists them)", "from") from None
    if name in manager.known() or name in CATALOG:
        raise bad_request(f"model {name!r} is a base model's name; pick another name for the adapter model", "model")
    path = adapter_files(body.get("adapters"))
    try:
        await load_adapter(manager, name, str(path), base_id)
    except BaseException:
        if path.parent == blob_folder() / "adapters" and str(path) not in manager.adapters.values():
            shutil.rmtree(path, ignore_errors=True)  # refused: no links to what it named stay behind
        raise
    return name


def adapter_files(adapters: Any) -> Path:
    """The adapter of /api/create's `adapters` ({file name: "sha256:..." blob digest or a local path}): a GGUF LoRA
    file, or a PEFT folder (adapter_config.json + adapter_model.safetensors, linked from their blobs)."""
    if not isinstance(adapters, dict) or not adapters or not all(
            isinstance(k, str) and isinstance(v, str) and k and v for k, v in adapters.items()):
        raise bad_request("adapters must be an object of {file name: blob digest 'sha256:...' or local path}",
                          "adapters")
    files = {Path(k).name: _file(v) for k, v in adapters.items()}
    if len(files) == 1:
        return next(iter(files.values()))
    need = {"adapter_config.json", "adapter_model.safetensors"}
    if set(files) != need:
        raise bad_request("adapters must be one GGUF LoRA file, or a PEFT adapter's adapter_config.json and "
                          f"adapter_model.safetensors; got {sorted(files)}", "adapters")
    folder = blob_folder() / "adapters" / hashlib.sha256(
        "\0".join(f"{k}={v}" for k, v in sorted(files.items())).encode()).hexdigest()[:32]
    folder.mkdir(parents=True, exist_ok=True)
    for file_name, target in files.items():
        link = folder / file_name
        if not link.is_symlink() or link.resolve() != target.resolve():
            link.unlink(missing_ok=True)
            link.symlink_to(target.resolve())
    return folder


def _file(value: str) -> Path:
    """A blob digest's file (pushed already) or a local path; a 400 naming `adapters` when it is not there."""
    path = blob_path(value, "adapters") if value.startswith("sha256") else Path(value).expanduser()
    if not path.is_absolute() or not path.exists():
        what = "blob" if value.startswith("sha256") else "path"
        raise bad_request(f"adapters: {what} {value!r} is not on this server (push blobs with POST "
                          "/api/blobs/sha256:...; local paths must be absolute)", "adapters")
    return path
