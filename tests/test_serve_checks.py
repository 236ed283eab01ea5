"""`edgeserve serve` checks its models and its port before it says it serves: `run`'s one-line errors, status 1."""

from __future__ import annotations

import socket

import pytest

from edgeserve.cli import main
from server_helpers import free_port
from tiny_gguf import write_tiny_llama


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    """A cache folder with nothing pulled, so no test here downloads anything."""
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path / "home"))


@pytest.fixture(autouse=True)
def no_uvicorn(monkeypatch):
    """Should a check be missed, `serve` returns at once instead of serving forever (and the test fails)."""
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: None)


def serve_error(capsys, *argv: str) -> str:
    """`edgeserve serve ARGV` on a free port: it must fail with status 1 and one line; that line."""
    assert main(["serve", "--port", str(free_port()), *argv]) == 1
    err = capsys.readouterr().err
    assert "serving" not in err and len(err.splitlines()) == 1, err
    return err


def run_error(capsys, model: str) -> str:
    assert main(["run", model, "hi"]) == 1
    return capsys.readouterr().err


@pytest.mark.parametrize("model, says", [
    ("nosuchmodel", "unknown model 'nosuchmodel'"),
    ("notes.txt", "is not a .gguf file"),
    ("missing/model.gguf", "model path not found"),
    ("text.gguf", "is not a GGUF file"),
])
def test_a_model_that_is_not_there_is_run_s_line_before_serving(model, says, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("shopping list\n")
    (tmp_path / "text.gguf").write_text("not a model at all\n")
    err = serve_error(capsys, "-m", model)
    assert err.startswith("edgeserve: error:") and says in err
    assert err == run_error(capsys, model)  # the very line `edgeserve run` prints
    if model == "nosuchmodel":
        assert "qwen2.5-1.5b" in err  # the catalog listed includes the models pulled from Hugging Face


def test_an_unpulled_catalog_model_with_no_pull_is_refused_at_start(capsys):
    err = serve_error(capsys, "--no-pull", "-m", "smollm2-135m")
    assert "not pulled yet" in err and "edgeserve pull smollm2-135m" in err


def test_a_port_in_use_is_one_line_naming_it(tmp_path, capsys):
    tiny = write_tiny_llama(tmp_path / "tiny.gguf")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port), "-m", str(tiny)]) == 1
    err = capsys.readouterr().err
    assert err == (f"edgeserve: error: port {port} on 127.0.0.1 is already in use (another edgeserve or other "
                   f"server); stop it or pick another port with --port {port + 1}\n")


def test_serve_checks_pass_for_a_good_model_and_a_free_port(tmp_path):
    from edgeserve.serve_checks import check_models, check_port

    check_port("127.0.0.1", free_port())
    check_models([str(write_tiny_llama(tmp_path / "tiny.gguf"))], allow_pull=False)
