"""The first `edgeserve run` on the default model says what it is for and which catalog model to pull."""

from __future__ import annotations

import pytest

from edgeserve.cli import main
from edgeserve.errors import EdgeserveError
from edgeserve.first_run import RECOMMENDED_MODEL
from edgeserve.registry.catalog import DEFAULT_MODEL, HF_CATALOG


class StopBeforeLoading(EdgeserveError):
    pass


@pytest.fixture
def no_load(tmp_path, monkeypatch):
    """An empty cache folder, and an LLM that refuses to load (so nothing is pulled or loaded)."""
    import edgeserve.llm

    def refuse(*args, **kwargs):
        raise StopBeforeLoading("not loading in this test")

    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(edgeserve.llm, "LLM", refuse)


def test_the_first_run_on_the_default_model_says_what_to_pull_once(no_load, capsys):
    assert RECOMMENDED_MODEL in HF_CATALOG
    assert main(["run", "hello"]) == 1
    first = capsys.readouterr().err
    assert f"{DEFAULT_MODEL}, the default model, is a 135M model" in first
    assert f"edgeserve pull {RECOMMENDED_MODEL}" in first
    assert main(["run", "hello"]) == 1
    assert "135M" not in capsys.readouterr().err  # once per cache folder


def test_no_hint_for_another_model(no_load, tmp_path, capsys):
    assert main(["run", str(tmp_path / "other.gguf"), "hello"]) == 1
    assert "135M" not in capsys.readouterr().err
