"""End to end through the real `edgeserve` processes: the disk KV tier across a SIGTERM restart (and a corrupted
block recomputed), speculative decoding equal to plain greedy, a Hugging Face folder served, `--quantize int4`
through `edgeserve run`."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from server_helpers import free_port, metric
from tiny_gguf import write_tiny_llama

PROMPT = "The river ran past the old mill, and the miller sang to the river as the wheel turned."


@contextlib.contextmanager
def edgeserve_serve(tmp_path: Path, *args: str) -> Iterator[httpx.Client]:
    """`edgeserve serve ARGS` as its own process on a free port; a client once /health answers; SIGTERM at the end
    (the process must end cleanly, without a traceback)."""
    port = free_port()
    log = tmp_path / f"serve-{port}.log"
    env = {**os.environ, "EDGESERVE_HOME": str(tmp_path / "home")}
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "edgeserve", "serve", "--port", str(port), "--no-pull",
                                 "--keep-alive", "-1", *args], stdout=err, stderr=err, env=env)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as c:
            deadline = time.monotonic() + 300
            while True:  # the process is up when /health answers
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                with contextlib.suppress(httpx.TransportError):
                    if c.get("/health").status_code == 200:
                        break
                time.sleep(0.1)
            yield c
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught (the conventional exit status)
        assert proc.wait(timeout=300) in (0, -signal.SIGTERM), log.read_text()
        assert "Traceback" not in log.read_text(), log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def complete(c: httpx.Client, prompt: str = PROMPT, **kw) -> dict:
    """A greedy /v1/completions request; the response body."""
    r = c.post("/v1/completions", json={"model": kw.pop("model", "tiny"), "prompt": prompt, "max_tokens": 12,
                                         "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def offload_metric(c: httpx.Client, key: str) -> float:
    value = metric(c.get("/metrics").text, f"edgeserve_kv_offload_{key}", 'model="tiny"')
    assert value is not None, key
    return value


@pytest.fixture
def tiny(tmp_path) -> Path:
    return write_tiny_llama(tmp_path / "tiny.gguf")


def test_disk_kv_tier_survives_a_sigterm_restart_and_a_corrupt_block(tmp_path, tiny):
    kv = tmp_path / "kv"
    args = ("--model", str(tiny), "--kv-offload", "cpu,disk", "--disk-kv-path", str(kv), "--kv-cache-gb", "0.01")
    with edgeserve_serve(tmp_path, *args) as c:
        first = complete(c)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    files = [p for p in kv.rglob("*") if p.is_file() and p.stat().st_size > 1000]
    assert len(files) >= 4  # SIGTERM wrote the prompt's blocks
    with edgeserve_serve(tmp_path, *args) as c:
        again = complete(c)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 4  # found on disk, not recomputed
        assert offload_metric(c, "disk_hits") >= 4
    for path in [p for p in kv.rglob("*") if p.is_file() and p.stat().st_size > 1000]:  # damage every block
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF  # a byte of the K/V payload, at the end of the file
        path.write_bytes(bytes(data))
    with edgeserve_serve(tmp_path, *args) as c:
        fixed = complete(c)
        assert fixed["choices"][0]["text"] == first["choices"][0]["text"]  # recomputed, identical
        assert fixed["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert offload_metric(c, "corrupt_blocks") >= 1 and offload_metric(c, "disk_hits") == 0


def test_speculative_decoding_through_the_server_equals_plain_greedy(tmp_path, tiny):
    # the tiny model's greedy reply at bf16 repeats itself, so prompt lookup has drafts to accept (its file is F32,
    # which the default dtype would keep at float32); stop strings cut it at several places, some inside an accepted
    # run of drafts (where usage must not count the tokens after it)
    model = ("--model", str(tiny), "--dtype", "bfloat16")
    with edgeserve_serve(tmp_path, *model) as c:
        plain = complete(c, max_tokens=40)
        text = plain["choices"][0]["text"]
        stops = sorted({text[k:k + 2] for k in range(2, len(text) - 2, 2)} - {""})
        plain_stopped = [complete(c, max_tokens=40, stop=[stop]) for stop in stops]
    assert len(stops) >= 3 and all(r["choices"][0]["finish_reason"] == "stop" for r in plain_stopped)
    with edgeserve_serve(tmp_path, *model, "--speculative", "ngram") as c:
        spec = complete(c, max_tokens=40)
        spec_stopped = [complete(c, max_tokens=40, stop=[stop]) for stop in stops]
        scrape = c.get("/metrics").text
        accepted = metric(scrape, "edgeserve_spec_accepted_tokens", 'model="tiny"')
        proposed = metric(scrape, "edgeserve_spec_proposed_tokens", 'model="tiny"')
    assert spec["choices"][0]["text"] == text
    drafts = [r["usage"].pop("completion_tokens_details", None) for r in [spec, *spec_stopped]]
    assert spec["usage"] == plain["usage"]
    assert [r["choices"][0] for r in spec_stopped] == [r["choices"][0] for r in plain_stopped]
    # exact completion_tokens, though the drafts ran past the stop string
    assert [r["usage"] for r in spec_stopped] == [r["usage"] for r in plain_stopped]
    assert accepted is not None and accepted > 0  # speculation really ran
    # each reply's usage counts its own drafts (OpenAI's predicted-output fields): together the server's totals
    assert drafts[0] is not None and drafts[0]["accepted_prediction_tokens"] > 0
    assert drafts[0]["speculative_verifications"] > 0
    assert sum(d["accepted_prediction_tokens"] for d in drafts if d) == accepted
    assert sum(d["accepted_prediction_tokens"] + d["rejected_prediction_tokens"] for d in drafts if d) == proposed


@pytest.mark.slow
def test_hugging_face_folder_served_end_to_end(tmp_path, default_model_hf_fp16):
    from edgeserve.llm import LLM
    from edgeserve.sampling_params import SamplingParams

    name = default_model_hf_fp16.name
    messages = [{"role": "user", "content": "What is the capital of Japan?"}]
    llm = LLM(str(default_model_hf_fp16), device="cpu")
    expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12))[0].text
    assert expected
    with edgeserve_serve(tmp_path, "--model", str(default_model_hf_fp16), "--device", "cpu") as c:
        assert name in [m["id"] for m in c.get("/v1/models").json()["data"]]
        r = c.post("/v1/chat/completions", json={"model": name, "messages": messages, "max_tokens": 12,
                                                 "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == expected
        r = c.post("/api/chat", json={"model": name, "messages": messages, "stream": False,
                                      "options": {"num_predict": 12, "temperature": 0}})
        assert r.status_code == 200 and r.json()["message"]["content"] == expected, r.text


def test_quantize_int4_through_edgeserve_run(tmp_path):
    from edgeserve.kernels.formats.quant_linear import Int4Weight
    from edgeserve.llm import LLM
    from edgeserve.sampling_params import SamplingParams

    path = write_tiny_llama(tmp_path / "f16.gguf", qtype="F16", hidden=64, ffn=128)
    llm = LLM(str(path), device="cpu", quantize="int4", quantize_group_size=32)
    assert isinstance(llm.lm.model.layers[0].down, Int4Weight)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    expected = llm.generate(["the mill"], greedy)[0].text
    plain = LLM(str(path), device="cpu").generate(["the mill"], greedy)[0].text
    assert expected and expected != plain  # the int4 weights really change the reply (from its first token)
    proc = subprocess.run([sys.executable, "-m", "edgeserve", "run", str(path), "--quantize", "int4",
                           "--quantize-group-size", "32", "--device", "cpu", "--raw", "--temperature", "0",
                           "--max-tokens", "8", "the mill"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected + "\n"
