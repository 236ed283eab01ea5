"""The `edgeserve` command line: errors are one clear line with a non-zero exit; run streams a reply."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tiny_gguf import write_tiny_llama


def edgeserve(*args: str, env_home: Path | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ)
    if env_home is not None:
        env["EDGESERVE_HOME"] = str(env_home)
    return subprocess.run([sys.executable, "-m", "edgeserve", *args], capture_output=True, text=True,
                          input=stdin, env=env, timeout=300)


def assert_one_line_error(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_missing_file(tmp_path):
    assert_one_line_error(edgeserve("run", str(tmp_path / "nope.gguf"), "hi"), "not found")


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip, not a model" * 10)
    assert_one_line_error(edgeserve("run", str(bad), "hi"), "not a GGUF")


def test_truncated_gguf(tmp_path):
    good = write_tiny_llama(tmp_path / "good.gguf")
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    assert_one_line_error(edgeserve("run", str(cut), "hi"), "truncated")


def test_unknown_model_name(tmp_path):
    assert_one_line_error(edgeserve("run", "--model", "no-such-model", "hi", env_home=tmp_path),
                          "unknown model", "smollm2-135m")


def test_unsupported_architecture(tmp_path):
    path = write_tiny_llama(tmp_path / "gpt2.gguf", arch="gpt2")
    assert_one_line_error(edgeserve("run", str(path), "hi"), "architecture 'gpt2' is not supported")


def test_unsupported_quant_type(tmp_path):
    path = write_tiny_llama(tmp_path / "tq2.gguf", hidden=256, ffn=256, qtype="TQ2_0")
    assert_one_line_error(edgeserve("run", str(path), "hi"), "TQ2_0")


def test_missing_tensor(tmp_path):
    path = write_tiny_llama(tmp_path / "missing.gguf", skip_tensor="blk.1.ffn_up.weight")
    assert_one_line_error(edgeserve("run", str(path), "hi"), "blk.1.ffn_up.weight", "missing")


def test_bad_sampling_flag(tmp_path):
    path = write_tiny_llama(tmp_path / "t.gguf")
    assert_one_line_error(edgeserve("run", str(path), "hi", "--top-p", "0"), "top_p")


def test_pull_unknown(tmp_path):
    assert_one_line_error(edgeserve("pull", "nope", env_home=tmp_path), "unknown model")


def test_run_tiny_model_streams_text(tmp_path):
    path = write_tiny_llama(tmp_path / "t.gguf")
    proc = edgeserve("run", str(path), "hello", "--max-tokens", "8", "--temperature", "0", "--raw")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("\n")


@pytest.mark.slow
def test_run_default_model_matches_python_api(default_model_path, default_model_fp32):
    from edgeserve.llm import LLM
    from edgeserve.sampling_params import SamplingParams

    lm = default_model_fp32
    prompt = "What is the capital of France?"
    ids = lm.tokenizer.encode(lm.chat_template.render([{"role": "user", "content": prompt}]), add_special_tokens=False)
    expected = LLM.from_model(lm, kv_cache_gb=0.05).generate([ids], SamplingParams(temperature=0.0, max_tokens=24))[0].text
    proc = edgeserve("run", str(default_model_path), prompt, "--temperature", "0", "--max-tokens", "24",
                     "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected + "\n"
    assert "Paris" in proc.stdout



@pytest.mark.parametrize("argv, flag", [
    (["run", "--dense-prefill", "maybe"], "--dense-prefill"),
    (["serve", "--port", "x"], "--port"),
    (["frob"], "command"),
])
def test_bad_arguments_are_one_line_and_exit_1(argv, flag, capsys):
    from edgeserve.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1
    assert err[0].startswith("edgeserve: error:") and flag in err[0]
