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


def tiny_greedy_reply(path: Path, prompt: str, max_tokens: int) -> str:
    """What the Python API answers to the raw prompt, greedily (what `run --raw --temperature 0` must print)."""
    from edgeserve.llm import LLM
    from edgeserve.sampling_params import SamplingParams

    text = LLM(str(path)).generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))[0].text
    assert text  # the tiny model's greedy reply is not empty, so an empty reply cannot pass below
    return text


def test_run_tiny_model_streams_text(tmp_path):
    path = write_tiny_llama(tmp_path / "t.gguf")
    proc = edgeserve("run", str(path), "hello", "--max-tokens", "8", "--temperature", "0", "--raw")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == tiny_greedy_reply(path, "hello", 8) + "\n"
    assert proc.stderr == ""  # not a terminal: no loading line


def test_run_takes_flags_between_model_and_prompt(tmp_path):
    path = write_tiny_llama(tmp_path / "t.gguf")
    proc = edgeserve("run", str(path), "--max-tokens", "8", "--temperature", "0", "hello", "--raw")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == tiny_greedy_reply(path, "hello", 8) + "\n"


def parsed_run(argv: list[str], monkeypatch) -> tuple[str, str | None]:
    """`main(argv)` up to the point `run` would load a model: the (model, prompt) it would use."""
    from edgeserve import cli

    seen = []
    monkeypatch.setitem(cli.COMMANDS, "run", lambda args: seen.append(cli.split_model_and_prompt(args)) or 0)
    assert cli.main(argv) == 0
    return seen[0]


def test_run_positionals_name_a_model_only_if_they_are_one(monkeypatch, tmp_path):
    from edgeserve.registry import DEFAULT_MODEL

    long_prompt = "Summarize this, please: " + "the quick brown fox jumps over the lazy dog; " * 8
    assert len(long_prompt.encode()) > 255  # longer than a file name may be (it was probed as one: Errno 36)
    assert parsed_run(["run", long_prompt], monkeypatch) == (DEFAULT_MODEL, long_prompt)
    assert parsed_run(["run", "hello"], monkeypatch) == (DEFAULT_MODEL, "hello")
    assert parsed_run(["run", DEFAULT_MODEL], monkeypatch) == (DEFAULT_MODEL, None)
    assert parsed_run(["run", DEFAULT_MODEL, "--max-tokens", "200", "prompt"], monkeypatch) == (DEFAULT_MODEL, "prompt")
    assert parsed_run(["run", "--max-tokens", "200", DEFAULT_MODEL, long_prompt], monkeypatch) == (DEFAULT_MODEL,
                                                                                                  long_prompt)
    path = write_tiny_llama(tmp_path / "t.gguf")
    assert parsed_run(["run", str(path), "--temperature", "0", "hi", "--raw"], monkeypatch) == (str(path), "hi")


@pytest.mark.parametrize("argv, words", [
    (["run", "m", "--max-tokens", "2", "hello", "world"], ["at most a model and one prompt"]),
    (["run", "hello", "--no-such-flag"], ["unrecognized arguments", "--no-such-flag"]),
    (["list", "extra"], ["unrecognized arguments", "extra"]),
])
def test_run_extra_words_are_one_line_errors(argv, words, capsys):
    from edgeserve.cli import main

    with pytest.raises(SystemExit) as e:
        code = main(argv)
        raise SystemExit(code)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1, err
    assert all(w in err[0] for w in words), err


@pytest.mark.slow
def test_run_long_prompt_on_the_default_model(default_model_path):
    long_prompt = "Summarize this, please: " + "the quick brown fox jumps over the lazy dog; " * 8
    proc = edgeserve("run", long_prompt, "--max-tokens", "4", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


def test_loading_line_on_a_terminal_only(tmp_path):
    """`run` shows `loading MODEL ... Ns` on a terminal while the model loads, then erases it."""
    import os
    import pty

    path = write_tiny_llama(tmp_path / "t.gguf")
    primary, secondary = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-m", "edgeserve", "run", str(path), "hi", "--max-tokens", "2",
                               "--raw"], stdout=subprocess.PIPE, stderr=secondary, text=True, timeout=300)
        os.close(secondary)
        secondary = -1
        seen = b""
        while True:
            try:
                chunk = os.read(primary, 4096)
            except OSError:  # EIO: the terminal's other end is closed and everything was read
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(primary)
        if secondary >= 0:
            os.close(secondary)
    assert proc.returncode == 0, seen
    text = seen.decode()
    assert f"\rloading {path} ... 0s" in text and text.endswith("\r\033[K"), text
    assert "\n" not in text  # one line, redrawn in place


def test_loading_line_draws_and_erases():
    import io

    from edgeserve.load_progress import LoadingLine

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    with LoadingLine("tiny", out):
        pass
    assert out.getvalue() == "\rloading tiny ... 0s\r\033[K"
    pipe = io.StringIO()
    with LoadingLine("tiny", pipe):
        pass
    assert pipe.getvalue() == ""


@pytest.mark.slow
def test_run_default_model_matches_python_api(default_model_path, default_model_fp32):
    from edgeserve.llm import LLM
    from edgeserve.sampling_params import SamplingParams

    lm = default_model_fp32
    prompt = "What is the capital of France?"
    ids = lm.tokenizer.encode(lm.chat_template.render([{"role": "user", "content": prompt}]), add_special_tokens=False)
    expected = LLM.from_model(lm, kv_cache_gb=0.05).generate([ids], SamplingParams(temperature=0.0, max_tokens=24))[0].text
    proc = edgeserve("run", str(default_model_path), prompt, "--temperature", "0", "--max-tokens", "24",
                     "--dtype", "float32", "--device", "cpu")  # the device the reference ran on
    assert proc.returncode == 0, proc.stderr
    assert expected.strip() and proc.stdout == expected + "\n"



@pytest.mark.parametrize("argv, flag", [
    (["run", "--dense-prefill", "maybe"], "--dense-prefill"),
    (["serve", "--port", "x"], "--port"),
    (["serve", "--max-decode-slowdown", "abc"], "--max-decode-slowdown"),
    (["frob"], "command"),
])
def test_bad_arguments_are_one_line_and_exit_1(argv, flag, capsys):
    from edgeserve.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1
    assert err[0].startswith("edgeserve: error:") and flag in err[0]


@pytest.mark.parametrize("value, expected", [("2.5", 2.5), ("off", None), (None, 1.5)])
def test_max_decode_slowdown_flag_reaches_the_scheduler(value, expected):
    from edgeserve.cli import build_parser, engine_config_from_args

    argv = ["run", "hi"] + (["--max-decode-slowdown", value] if value else [])
    config = engine_config_from_args(build_parser().parse_args(argv))
    assert config.max_decode_slowdown == expected
    assert config.scheduler_config().max_decode_slowdown == expected


def test_max_decode_slowdown_below_one_is_one_line(capsys):
    from edgeserve.cli import main

    assert main(["serve", "--max-decode-slowdown", "0.5"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--max-decode-slowdown" in err[0] and "at least 1.0" in err[0]
