"""edgeserve.bench on synthetic data: statistics, SSE token counting, Poisson arrivals, workload builders."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgeserve.bench.client import RequestResult, parse_sse_lines
from edgeserve.bench.stats import goodput, percentiles_ms, request_times, summarize, tpot
from edgeserve.bench.workloads import TokenSource, chat_workload, copy_workload, fixed_workload, poisson_arrivals


def result(start: float, gaps: list[float], end_extra: float = 0.0, usage_tokens: int | None = None) -> RequestResult:
    """A finished request: the first chunk `gaps[0]` after start, then one chunk per further gap."""
    times = (start + np.cumsum(gaps)).tolist()
    return RequestResult(True, start, times[-1] + end_extra, chunk_times=times, chunks=len(times),
                         completion_tokens=usage_tokens, expected_prompt_tokens=10)


def test_percentiles_match_definition():
    x = np.arange(1, 101) / 1000.0  # 1..100 ms
    p = percentiles_ms(x)
    assert p.p50 == pytest.approx(50.5) and p.p90 == pytest.approx(90.1) and p.p99 == pytest.approx(99.01)
    assert p.mean == pytest.approx(50.5) and p.n == 100
    assert percentiles_ms([float("nan"), 0.002]).p50 == pytest.approx(2.0)  # NaNs ignored
    assert percentiles_ms([]).p99 is None


def test_tpot_formula():
    # e2e 1.0 s, ttft 0.1 s, 10 tokens: (1.0 - 0.1) / 9 = 0.1 s per token after the first
    t = tpot(np.array([1.0, 0.5]), np.array([0.1, 0.5]), np.array([10, 1]))
    assert t[0] == pytest.approx(0.1) and np.isnan(t[1])


def test_summary_rates_and_latencies():
    # two requests: ttft 0.2 s then 4 more chunks every 50 ms; one failure
    rs = [result(0.0, [0.2, 0.05, 0.05, 0.05, 0.05]), result(1.0, [0.4, 0.05, 0.05, 0.05, 0.05]),
          RequestResult(False, 0.0, 0.1, error="HTTP 500: boom")]
    s = summarize(rs, duration_s=2.0)
    assert s.completed == 2 and s.errors == 1 and s.error_messages == ["HTTP 500: boom"]
    assert s.output_tokens == 10 and s.token_count_source == "chunks"
    assert s.output_tokens_per_s == pytest.approx(5.0) and s.total_tokens_per_s == pytest.approx(15.0)
    assert s.requests_per_s == pytest.approx(1.0)
    assert s.ttft_ms.p50 == pytest.approx(300.0) and s.ttft_ms.p99 == pytest.approx(398.0)
    assert s.tpot_ms.p50 == pytest.approx(50.0) and s.itl_ms.p99 == pytest.approx(50.0)
    assert s.e2e_ms.p50 == pytest.approx(500.0)
    assert s.goodput_requests_per_s is None  # no SLO given
    json.dumps(s.to_dict())


def test_goodput_counts_requests_meeting_both_slos():
    ttft = np.array([0.1, 0.3, 0.1, 0.1])
    tp = np.array([0.01, 0.01, 0.05, np.nan])
    assert goodput(ttft, tp, 2.0, 200, 20) == pytest.approx(1.0)  # #0 and #3 (1 token) meet both
    assert goodput(ttft, tp, 2.0, 200, None) == pytest.approx(1.5)
    assert goodput(ttft, tp, 2.0, None, 20) == pytest.approx(1.5)
    s = summarize([result(0, [0.1, 0.01, 0.01]), result(0, [0.5, 0.01, 0.01])], 1.0, slo_ttft_ms=200)
    assert s.goodput_requests_per_s == pytest.approx(1.0)


def test_token_count_from_usage_wins_over_chunks():
    r = result(0.0, [0.1, 0.1, 0.1], usage_tokens=5)  # 3 chunks carried 5 tokens
    assert r.output_tokens == 5 and r.token_source == "usage"
    t = request_times([r])
    assert t.tpot[0] == pytest.approx((0.3 - 0.1) / 4)
    assert summarize([r], 1.0).token_count_source == "usage"
    assert summarize([r, result(0.0, [0.1, 0.1])], 1.0).token_count_source == "mixed"


def test_sse_parsing_counts_content_chunks_and_reads_usage():
    lines = [
        'data: {"choices": [{"index": 0, "text": "Hel", "finish_reason": null}], "usage": null}', "",
        'data: {"choices": [{"index": 0, "text": "", "finish_reason": null}]}',  # empty: no token
        'data: {"choices": [{"index": 0, "text": "lo", "finish_reason": "length"}]}',
        ': keep-alive comment',
        'data: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}',
        "data: [DONE]",
    ]
    st = parse_sse_lines(lines)
    assert st.texts == ["Hel", "lo"] and st.done and st.error is None
    assert st.usage["completion_tokens"] == 2
    chat = parse_sse_lines([
        'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}',
        'data: {"choices": [{"delta": {"content": "Hi"}}]}', 'data: {"choices": [{"delta": {"content": "!"}}]}',
        "data: [DONE]"])
    assert chat.texts == ["Hi", "!"] and chat.usage is None
    err = parse_sse_lines(['data: {"choices": [{"text": "a"}]}', 'data: {"error": {"message": "engine failed"}}'])
    assert err.error == "engine failed"


def test_poisson_arrivals_seeded_with_the_right_mean():
    a = poisson_arrivals(20000, rate=4.0, seed=3)
    assert a[0] == 0.0 and np.all(np.diff(a) >= 0)
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() == pytest.approx(0.25, rel=0.05)  # exponential: std == mean
    assert np.array_equal(a, poisson_arrivals(20000, 4.0, seed=3))
    assert not np.array_equal(a, poisson_arrivals(20000, 4.0, seed=4))
    assert np.all(poisson_arrivals(5, float("inf")) == 0)
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0)


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from edgeserve.bench.command import load_tokenizer

    return load_tokenizer(str(default_model_path))[0]


def test_fixed_workload_exact_token_counts(tokenizer):
    w = fixed_workload(TokenSource(tokenizer), 5, prompt_tokens=37, max_tokens=9, seed=1)
    assert w.prompt_format == "token ids" and len(w.requests) == 5
    assert all(isinstance(r.prompt, list) and len(r.prompt) == 37 and r.prompt_tokens == 37 for r in w.requests)
    assert all(r.max_tokens == 9 for r in w.requests)
    assert len({tuple(r.prompt) for r in w.requests}) == 5  # distinct prompts
    again = fixed_workload(TokenSource(tokenizer), 5, prompt_tokens=37, max_tokens=9, seed=1)
    assert [r.prompt for r in again.requests] == [r.prompt for r in w.requests]  # seeded
    text = fixed_workload(TokenSource(tokenizer, as_ids=False), 3, prompt_tokens=50, max_tokens=4)
    assert text.prompt_format == "text"
    for r in text.requests:
        n = len(tokenizer.encode(r.prompt, add_special_tokens=False))
        assert r.prompt_tokens == n and abs(n - 50) <= 5  # about N, and the reported count is the real one


def test_shared_prefix_really_shared(tokenizer):
    w = fixed_workload(TokenSource(tokenizer), 4, prompt_tokens=20, max_tokens=4, seed=2, shared_prefix_tokens=64)
    prefixes = {tuple(r.prompt[:64]) for r in w.requests}
    suffixes = {tuple(r.prompt[64:]) for r in w.requests}
    assert len(prefixes) == 1 and len(suffixes) == 4
    assert all(len(r.prompt) == 84 and r.shared_prefix_tokens == 64 for r in w.requests)


def test_chat_and_copy_workloads(tokenizer):
    src = TokenSource(tokenizer)
    c = chat_workload(src, 200, seed=5, mean_prompt_tokens=100, mean_output_tokens=50)
    lens = np.array([r.prompt_tokens for r in c.requests])
    outs = np.array([r.max_tokens for r in c.requests])
    assert lens.std() > 20 and 60 < lens.mean() < 150 and 30 < outs.mean() < 75  # varied, around the means
    assert all(len(r.prompt) == r.prompt_tokens for r in c.requests)
    assert [r.prompt_tokens for r in chat_workload(src, 200, seed=5, mean_prompt_tokens=100,
                                                   mean_output_tokens=50).requests] == lens.tolist()
    cp = copy_workload(src, 2, prompt_tokens=80, max_tokens=16, seed=0)
    for r in cp.requests:  # the passage appears twice, and the prompt ends with its first tokens
        p = r.prompt
        head = p[-4:]
        starts = [i for i in range(len(p) - 4) if p[i:i + 4] == head]
        assert len(starts) >= 2
        n = 32
        assert p[starts[0]:starts[0] + n] == p[starts[1]:starts[1] + n]


def test_words_without_a_tokenizer():
    w = fixed_workload(TokenSource(None), 2, prompt_tokens=30, max_tokens=4, seed=0)
    assert w.prompt_format == "text" and all(len(r.prompt.split()) == 30 for r in w.requests)


def synthetic_report(levels=(1, 2, 4)):
    from edgeserve.bench.report import BenchReport
    from edgeserve.bench.runner import LevelResult, LoadLevel

    out = []
    for c in levels:
        rs = [result(0.0, [0.1 * c, 0.02 * c, 0.02 * c]) for _ in range(3)]
        out.append(LevelResult(LoadLevel(concurrency=c), rs, summarize(rs, 1.0)))
    return BenchReport("http://x", "edgeserve", "m", "fixed", "token ids", {}, out)


def test_table_and_json_report(tmp_path):
    from edgeserve.bench.report import format_table, write_json

    rep = synthetic_report()
    table = format_table(rep)
    assert "concurrency 4" in table and "counted from chunks" in table and "prompts as token ids" in table
    write_json(rep, str(tmp_path / "r.json"))
    doc = json.loads((tmp_path / "r.json").read_text())
    assert [lv["concurrency"] for lv in doc["levels"]] == [1, 2, 4]
    assert doc["levels"][2]["summary"]["ttft_ms"]["p50"] == pytest.approx(400.0)
    assert len(doc["levels"][0]["requests"]) == 3


def test_plot_written_or_clear_error(tmp_path, monkeypatch):
    import sys

    from edgeserve.bench.plot import MISSING, plot_report, require_matplotlib
    from edgeserve.errors import EdgeserveError

    import matplotlib  # noqa: F401  (in the test extras: a broken install fails here)

    plot_report(synthetic_report(), str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(EdgeserveError, match="pip install 'edgeserve\\[plot\\]'") as e:
        require_matplotlib()
    assert str(e.value) == MISSING and "\n" not in MISSING


def test_roofline_arithmetic(default_model_path):
    from edgeserve.bench.roofline import gguf_weight_bytes, model_kv_bytes_per_token, roofline

    total, per_token = gguf_weight_bytes(default_model_path)
    assert 50e6 < per_token <= total < default_model_path.stat().st_size  # tensor data, not the whole file
    kv = model_kv_bytes_per_token(default_model_path)
    assert kv == 2 * 30 * 3 * 64 * 2  # SmolLM2-135M: 30 layers, 3 KV heads of 64, K and V, bfloat16
    r = roofline(default_model_path, mean_context=100, bandwidth_gbs=10.0, measured_tokens_per_s=50.0)
    assert r.bytes_per_token == per_token + kv * 100
    assert r.max_tokens_per_s == pytest.approx(10e9 / r.bytes_per_token)
    assert r.bandwidth_source == "--mem-bandwidth-gbs" and r.fraction == pytest.approx(50 / r.max_tokens_per_s)


def test_speculative_counts_from_usage_reach_the_summary_and_the_table():
    """The server's per-request draft counts (usage.completion_tokens_details) become the level's acceptance and
    tokens per verification step, in the summary and the printed table; without them, neither is claimed."""
    import anyio
    import httpx

    from edgeserve.bench.client import stream_completion
    from edgeserve.bench.report import BenchReport, format_table
    from edgeserve.bench.runner import LevelResult, LoadLevel
    from edgeserve.bench.workloads import RequestSpec

    def reply(accepted: int, rejected: int, steps: int):
        usage = {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12,
                 "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                               "rejected_prediction_tokens": rejected,
                                               "speculative_verifications": steps}}
        body = (f'data: {json.dumps({"choices": [{"text": "hi"}]})}\n\n'
                f'data: {json.dumps({"choices": [], "usage": usage})}\n\ndata: [DONE]\n\n')
        return httpx.MockTransport(lambda request: httpx.Response(200, text=body))

    async def one(transport):
        async with httpx.AsyncClient(transport=transport) as client:
            return await stream_completion(client, "http://x", RequestSpec([1, 2, 3], 3, 9), None)

    rs = [anyio.run(one, reply(6, 2, 3)), anyio.run(one, reply(2, 6, 5))]
    assert (rs[0].accepted_drafts, rs[0].rejected_drafts, rs[0].verifications) == (6, 2, 3)
    s = summarize(rs, 1.0)
    assert s.spec_acceptance_rate == pytest.approx(8 / 16)
    assert s.spec_tokens_per_step == pytest.approx(1 + 8 / 8)
    level = LoadLevel(concurrency=1)
    table = format_table(BenchReport("http://x", "edgeserve", "m", "w", "ids", {}, [LevelResult(level, rs, s)]))
    assert "50% of drafts accepted, 2.00 tokens per verification step" in table
    plain = summarize([result(0, [0.1, 0.01])], 1.0)
    assert plain.spec_acceptance_rate is None and plain.spec_tokens_per_step is None
