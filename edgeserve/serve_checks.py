"""What `edgeserve serve` checks before it says it serves: the port is free and every configured model can be found
and read. Each failure is an EdgeserveError with the same one line `edgeserve run` gives (exit status 1)."""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable

from edgeserve.errors import EdgeserveError


class PortInUseError(EdgeserveError):
    """The address `serve` should listen on is taken or cannot be used."""


def check_port(host: str, port: int) -> None:
    """Bind `host:port` the way uvicorn will (SO_REUSEADDR, IPv6 for a host with a colon) and let it go again;
    PortInUseError naming the port and what to do if that fails."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PortInUseError(f"port {port} on {host} is already in use (another edgeserve or other server); "
                                     f"stop it or pick another port with --port {_other_port(port)}") from None
            why = e.strerror or str(e)
            raise PortInUseError(f"cannot listen on {host}:{port}: {why}; pass another --host or --port") from None


def _other_port(port: int) -> int:
    """A port number to suggest instead of `port`."""
    return port + 1 if 0 < port < 65535 else 8001


def check_models(specs: Iterable[str], allow_pull: bool, load_format: str = "auto") -> None:
    """Make sure every model `serve` was given is there: a catalog or Hugging Face name is pulled (now, with a
    progress bar, when `allow_pull`; otherwise it must be pulled already), a path must exist and be a GGUF file
    (read to the end of its tensor list) or a model folder. Raises `run`'s one-line errors (UnknownModelError,
    ModelLoadError, PullError)."""
    from edgeserve.registry import resolve

    for spec in specs:
        source = resolve(spec, pull_missing=allow_pull)
        if source.kind == "gguf" and load_format != "dummy":
            from edgeserve.loaders.gguf_file import GGUFFile

            GGUFFile(source.path)  # the header, metadata and tensor list: a text file or a cut download fail here


def check_adapters(loras: Iterable[tuple[str, str]]) -> None:
    """Every --lora path exists (its contents are checked against the base when a request first runs it)."""
    from pathlib import Path

    for name, path in loras:
        if not Path(path).expanduser().exists():
            raise EdgeserveError(f"--lora {name}={path}: {path} does not exist")
