"""Errors that users see as one clear line (CLI) or a 4xx body (HTTP)."""


class EdgeserveError(Exception):
    """Base class: the message is meant for the user as it is."""


class ModelLoadError(EdgeserveError):
    """A model file or folder is missing, truncated, corrupt or incomplete."""


class UnsupportedModelError(EdgeserveError):
    """The model uses an architecture or quantization type edgeserve does not support."""


class UnknownModelError(EdgeserveError):
    """A model name is neither in the catalog nor a local path."""


class PullError(EdgeserveError):
    """Fetching a catalog model failed (network, pip, checksum)."""


class ChatTemplateError(EdgeserveError):
    """A chat template failed to compile or render (bad message order, unsafe access, template bug)."""


class QueueFullError(EdgeserveError):
    """The engine's waiting queue is full (HTTP 429)."""

    def __init__(self, message: str = "busy") -> None:
        super().__init__(message)


class InvalidRequestError(EdgeserveError, ValueError):
    """A request the engine refuses (HTTP 400); `param` names the offending field ("prompt", "logit_bias")."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(EdgeserveError, ValueError):
    """The prompt leaves no room in the model's context for even one new token (HTTP 400)."""


class EngineError(EdgeserveError):
    """The engine failed while running a step; the requests in flight were ended."""


class ConfigError(EdgeserveError, ValueError):
    """A bad setting. The message names the field and its command-line flag ("max_num_seqs must be a positive
    integer, got 0 (flag --max-seqs)"), so the Python API, the server and the CLI all show the same one line."""


def config_error(config_cls: type, name: str, requirement: str, value: object) -> ConfigError:
    """The ConfigError of field `name` of dataclass `config_cls` (its flag read from the field's `flag` metadata):
    "NAME must REQUIREMENT, got VALUE (flag FLAG)"."""
    from dataclasses import fields

    flag = next((f.metadata.get("flag") for f in fields(config_cls) if f.name == name), None)
    return ConfigError(f"{name} must {requirement}, got {repr(value)[:60]}" + (f" (flag {flag})" if flag else ""))


def check_field(config: object, name: str, requirement: str, check: "Callable[[Any], object]") -> None:
    """Run `check` on field `name` of the dataclass `config`; a ValueError it raises becomes that field's
    ConfigError (`config_error`)."""
    value = getattr(config, name)
    try:
        check(value)
    except ValueError:
        raise config_error(type(config), name, requirement, value) from None


def one_line_parse_errors(prog: str, *parsers) -> None:
    """Make argparse errors of these parsers one `PROG: error: ...` line and exit status 1."""
    import sys

    def error(message: str):
        print(f"{prog}: error: {message}", file=sys.stderr)
        sys.exit(1)

    for p in parsers:
        p.error = error


def run_reporting_errors(prog: str, fn) -> int:
    """Run `fn()` and return its exit status; any error becomes one `PROG: error: ...` line and status 1 (130 on
    Ctrl-C; 0 when stdout's reader closed it, as `| head` does). An exception group (a failed task group) is reported by its first leaf. EDGESERVE_DEBUG=1 re-raises
    unexpected errors with their traceback."""
    import os
    import sys

    try:
        try:
            return fn()
        except BaseExceptionGroup as group:
            inner: BaseException = group
            while isinstance(inner, BaseExceptionGroup):
                inner = inner.exceptions[0]
            raise inner from None
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `edgeserve list | head`: the reader has what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not complain again
        return 0
    except EdgeserveError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # never a traceback for the user
        if os.environ.get("EDGESERVE_DEBUG"):
            raise
        print(f"{prog}: error: {type(e).__name__}: {e} (set EDGESERVE_DEBUG=1 for details)", file=sys.stderr)
        return 1
