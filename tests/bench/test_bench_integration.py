"""`edgeserve bench` against a real edgeserve on the default model: report shape, token counts, JSON, CLI errors."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

from edgeserve.cli import build_parser, main
from edgeserve.registry import DEFAULT_MODEL
from edgeserve.server import ServerConfig
from edgeserve.engine.config import EngineConfig
from server_helpers import metric, serve

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(default_model_path):
    with serve(ServerConfig(engine=EngineConfig(max_num_seqs=4, kv_cache_gb=0.1),
                            models=(DEFAULT_MODEL,), keep_alive=None)) as s:
        yield s


def generated_tokens(url: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return metric(text, "edgeserve_generation_tokens_total", f'model="{DEFAULT_MODEL}"') or 0.0


def test_bench_a_running_server(server, default_model_path, tmp_path, capsys):
    out = tmp_path / "bench.json"
    before = generated_tokens(server.url)
    rc = main(["bench", "--url", server.url, "--model", str(default_model_path), "--num-requests", "4",
               "--prompt-tokens", "16", "--max-tokens", "8", "--concurrency", "2", "--warmup", "0",
               "--slo-ttft", "60000", "--slo-tpot", "60000", "--json", str(out), "--no-progress"])
    assert rc == 0
    table = capsys.readouterr().out
    assert "concurrency 2" in table and "prompts as token ids" in table and "counted from usage" in table

    doc = json.loads(out.read_text())
    assert doc["server_kind"] == "edgeserve" and doc["model"] == DEFAULT_MODEL
    assert doc["prompt_format"] == "token ids" and doc["workload"] == "fixed"
    (level,) = doc["levels"]
    assert level["concurrency"] == 2 and level["cancelled"] == 0
    s = level["summary"]
    assert s["completed"] == 4 and s["errors"] == 0 and s["token_count_source"] == "usage"
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert 0 < s[key]["p50"] <= s[key]["p90"] <= s[key]["p99"], key
    assert s["output_tokens_per_s"] > 0 and s["requests_per_s"] > 0
    assert s["goodput_requests_per_s"] == pytest.approx(s["requests_per_s"])  # a one-minute SLO: all meet it
    assert s["ttft_ms"]["p99"] <= s["e2e_ms"]["p99"]
    # per request: the server's usage says 16 prompt tokens (exact token-id prompts) and 8 generated
    # (ignore_eos), and the stream carried that text in at most 8 chunks
    for r in level["requests"]:
        assert r["ok"] and r["token_source"] == "usage"
        assert r["prompt_tokens"] == r["expected_prompt_tokens"] == 16
        assert r["output_tokens"] == 8 and 1 <= r["chunks"] <= 8
    assert s["output_tokens"] == 32 and s["prompt_tokens"] == 64
    # and the server's own counter agrees with what the bench counted
    assert generated_tokens(server.url) - before == s["output_tokens"]


def test_bench_json_to_stdout_and_rate(server, default_model_path, capsys):
    rc = main(["bench", "--url", server.url, "--model", str(default_model_path), "--num-requests", "2",
               "--prompt-tokens", "8", "--max-tokens", "4", "--request-rate", "50", "--warmup", "0", "--json", "-",
               "--no-progress", "--temperature", "0.8", "--top-p", "0.9"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)  # only the JSON on stdout
    assert doc["levels"][0]["request_rate"] == 50 and doc["levels"][0]["summary"]["completed"] == 2
    assert doc["workload_params"]["temperature"] == 0.8 and doc["workload_params"]["top_p"] == 0.9


def test_bench_cli_bad_flag_is_one_line():
    for argv in (["--concurrency", "0"], ["--no-such-flag"], ["--concurrency", "2", "--request-rate", "1"],
                 ["--num-requests", "0"], ["--temperature", "3"], ["--top-p", "0"]):
        proc = subprocess.run([sys.executable, "-m", "edgeserve", "bench", "--url", "http://127.0.0.1:9", *argv],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1, argv
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("edgeserve: error:"), (argv, proc.stderr)
        assert proc.stdout == ""


def test_bench_unreachable_server_is_one_line(capsys):
    assert main(["bench", "--url", "http://127.0.0.1:9", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot reach a server at http://127.0.0.1:9" in err[0]


def test_bench_flags_parse():
    a = build_parser().parse_args(["bench", "--concurrency", "1,4,8", "--request-rate", "0.5,inf"])
    assert a.concurrency == [1, 4, 8] and a.request_rate == [0.5, float("inf")]
