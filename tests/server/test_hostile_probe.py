"""What a hostile-client probe found after issue 22 (issue 39), each through the real server and each beside a
normal streamed request that must finish with exactly its text when alone."""

from __future__ import annotations

import json

import anyio
import httpx
import pytest

from edgeserve.engine.config import EngineConfig
from edgeserve.server import ServerConfig
from server_helpers import metric, serve
from test_hostile_requests import BYSTANDER, CHAT, _stream_text, ollama_400, openai_400, post, with_bystander
from tiny_gguf import write_tiny_llama


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("probe")
    return {"text": write_tiny_llama(d / "tiny.gguf"), "embed": write_tiny_llama(d / "tinyemb.gguf", pooling_type=1)}


@pytest.fixture(scope="module")
def server(paths):
    with serve(ServerConfig(engine=EngineConfig(kv_cache_gb=0.01), models=(str(paths["text"]), str(paths["embed"])),
                            keep_alive=None, max_loaded_models=2, max_n=4)) as s:
        yield s


@pytest.fixture(scope="module")
def alone_text(server) -> str:
    return anyio.run(_stream_text, server.url, BYSTANDER, None)


CHAT_BASE = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 1}


# --- 1. /metrics with an embedding model loaded; no route answers outside its API's shape --------------------------

def test_metrics_cover_a_loaded_embedding_model(server, alone_text):
    def send(c: httpx.AsyncClient):
        async def go():
            r = await c.post("/api/embed", json={"model": "tinyemb", "input": ["hello", "there you"]})
            assert r.status_code == 200, r.text
            scrapes = [await c.get("/metrics") for _ in range(2)]  # one keep-alive connection, two scrapes
            return r, scrapes
        return go()

    _, scrapes = with_bystander(server, alone_text, send)
    for s in scrapes:
        assert s.status_code == 200, s.text
    text = scrapes[-1].text
    labels = 'model="tinyemb"'
    assert metric(text, "edgeserve_embedding_requests_total", labels) >= 1
    assert metric(text, "edgeserve_embedding_inputs_total", labels) >= 2
    assert metric(text, "edgeserve_embedding_tokens_total", labels) >= len("hello") + len("there you") - 4
    assert metric(text, "edgeserve_embedding_request_latency_seconds_count", labels) >= 1
    assert metric(text, "edgeserve_num_requests_waiting", labels) == 0
    assert metric(text, "edgeserve_num_requests_running", 'model="tiny"') is not None  # the text model beside it


def test_a_route_that_fails_answers_in_its_api_shape_and_keeps_the_connection(server, monkeypatch):
    metrics = server.app.state.server.metrics

    def broken() -> bytes:
        raise RuntimeError("scrape failed")

    monkeypatch.setattr(metrics, "render", broken)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.get("/metrics")
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "server_error" and "RuntimeError" in err["message"]
        assert "Traceback" not in r.text
        # the same connection serves the next request
        r = c.post(CHAT, json=CHAT_BASE)
        assert r.status_code == 200, r.text


# --- 3. keep_alive NaN --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path,body", [
    ("/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": False}),
    ("/api/generate", {"model": "tiny", "prompt": "x", "stream": False}),
    ("/api/embed", {"model": "tinyemb", "input": "x"}),
])
def test_keep_alive_nan_is_400(server, alone_text, path, body):
    content = json.dumps({**body, "keep_alive": float("nan")}).encode()  # NaN: Python's json reads it
    assert b"NaN" in content
    r = with_bystander(server, alone_text, post(path, content=content))
    ollama_400(r, "keep_alive", "number")


# --- 4. /v1/responses max_output_tokens ------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [2**31, 2**63, 1e308])
def test_responses_max_output_tokens_has_the_same_bound_as_max_tokens(server, alone_text, value):
    body = {"model": "tiny", "input": "hi", "max_output_tokens": value}
    r = with_bystander(server, alone_text, post("/v1/responses", body))
    openai_400(r, "max_output_tokens", "max_output_tokens", "2147483647")


def test_responses_max_output_tokens_at_the_bound_is_accepted(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 2**31 - 1,
                                          "temperature": 0})
        assert r.status_code == 200, r.text


# --- 7. dimensions as an integral float; tool messages without tool_call_id ------------------------------------------

def test_dimensions_as_an_integral_float_counts_as_an_integer(server, alone_text):
    for path, key in (("/v1/embeddings", None), ("/api/embed", "embeddings")):
        r = with_bystander(server, alone_text, post(path, {"model": "tinyemb", "input": "hello", "dimensions": 8.0}))
        assert r.status_code == 200, r.text
        vec = r.json()["data"][0]["embedding"] if key is None else r.json()[key][0]
        assert len(vec) == 8
    r = with_bystander(server, alone_text, post("/v1/embeddings", {"model": "tinyemb", "input": "hi",
                                                                   "dimensions": 8.5}))
    openai_400(r, "dimensions", "positive integer")


def test_openai_tool_message_without_tool_call_id_is_400(server, alone_text):
    msgs = [{"role": "assistant", "content": None,
             "tool_calls": [{"id": "c", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
            {"role": "tool", "content": "ok"}]
    r = with_bystander(server, alone_text, post(CHAT, {**CHAT_BASE, "messages": msgs}))
    openai_400(r, "messages[1].tool_call_id", "tool_call_id")
    msgs[1]["tool_call_id"] = "c"
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert c.post(CHAT, json={**CHAT_BASE, "messages": msgs}).status_code == 200
        # Ollama's own API has no call ids: its tool messages stay accepted as Ollama accepts them
        r = c.post("/api/chat", json={"model": "tiny", "stream": False, "options": {"num_predict": 2},
                                      "messages": [{"role": "user", "content": "x"},
                                                   {"role": "tool", "content": "sunny"}]})
        assert r.status_code == 200, r.text


# --- 2. schemas no output can satisfy; grammar errors while decoding ---------------------------------------------

DEAD_SCHEMAS = {
    "self-ref": {"$ref": "#"},
    "defs-loop": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    "required-root": {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
    "huge-pattern": {"type": "string", "pattern": "^a{1000000}$"},
}


def _routes_with(schema: dict) -> list[tuple[str, dict, str | None]]:
    """(path, body, param) for every field that takes a schema; param None: an Ollama / Anthropic shape."""
    fn = {"name": "f", "parameters": schema}
    return [
        (CHAT, {**CHAT_BASE, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
         "response_format"),
        (CHAT, {**CHAT_BASE, "tools": [{"type": "function", "function": fn}], "tool_choice": "required"}, "tools"),
        (CHAT, {**CHAT_BASE, "tools": [{"type": "function", "function": fn}],
                "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
        ("/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": False,
                       "format": schema}, None),
        ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                          "tools": [{"name": "f", "input_schema": schema}], "tool_choice": {"type": "any"}}, None),
        ("/v1/responses", {"model": "tiny", "input": "x", "max_output_tokens": 4,
                           "text": {"format": {"type": "json_schema", "name": "s", "schema": schema}}}, "text.format"),
    ]


@pytest.mark.parametrize("name", sorted(DEAD_SCHEMAS))
def test_a_schema_no_output_satisfies_is_400_naming_the_field(server, alone_text, name):
    for path, body, param in _routes_with(DEAD_SCHEMAS[name]):
        r = with_bystander(server, alone_text, post(path, body))
        assert r.status_code == 400, (path, r.text)
        # (a root reference inside a tool's arguments can also fail to resolve: refused at compile time then)
        said = r.text.count("accepts no output") + r.text.count("cannot be compiled")
        assert said, r.text
        if param is not None:
            openai_400(r, param)
        elif path == "/v1/messages":
            assert r.json()["error"]["type"] == "invalid_request_error", r.text
        else:
            ollama_400(r)


# passes the compile-time probe (the first tokens are a choice), then fails once the recursion is reached
LATE_DEAD = {"$defs": {"r": {"type": "object", "properties": {"x": {"$ref": "#/$defs/r"}}, "required": ["x"]}},
             "type": "object", "properties": {"a": {"enum": ["p", "q"]}, "b": {"$ref": "#/$defs/r"}},
             "required": ["a", "b"]}


def test_a_grammar_error_while_decoding_ends_the_request_with_an_error(server, alone_text):
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": LATE_DEAD}}
    body = {**CHAT_BASE, "max_tokens": 60, "temperature": 0, "response_format": fmt}
    r = with_bystander(server, alone_text, post(CHAT, body))
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and "grammar failed while decoding" in err["message"], err

    async def stream(c: httpx.AsyncClient):
        events = []
        async with c.stream("POST", CHAT, json={**body, "stream": True}) as s:
            assert s.status_code == 200
            async for line in s.aiter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
        return events

    events = with_bystander(server, alone_text, stream)
    assert "grammar failed while decoding" in events[-1]["error"]["message"]
    assert all(ch["finish_reason"] is None for e in events[:-1] for ch in e["choices"])  # never a "stop"

    r = with_bystander(server, alone_text, post("/api/chat", {"model": "tiny", "stream": False, "format": LATE_DEAD,
                                                              "messages": [{"role": "user", "content": "hi"}]}))
    assert r.status_code == 500 and "grammar failed while decoding" in r.json()["error"], r.text


# --- 6. huge prompts are refused cheaply; rendering and tokenizing run off the event loop ----------------------------

def _on_event_loop() -> bool:
    import asyncio

    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


@pytest.fixture
def render_log(monkeypatch):
    """Where each chat prompt was rendered and tokenized: (what, on the event loop?, prompt characters)."""
    from edgeserve.server import generation

    calls = []
    real_setup, real_ids = generation.chat_setup, generation.chat_prompt_ids

    def setup(req, template, *rest):
        calls.append(("render", _on_event_loop(), sum(len(m["content"]) for m in req.messages)))
        return real_setup(req, template, *rest)

    def ids(tok, prompt):
        calls.append(("tokenize", _on_event_loop(), len(prompt)))
        return real_ids(tok, prompt)

    monkeypatch.setattr(generation, "chat_setup", setup)
    monkeypatch.setattr(generation, "chat_prompt_ids", ids)
    return calls


MANY = [{"role": "user", "content": "hi"}] * 100_000  # about 3.5 MB, under the body limit


@pytest.mark.parametrize("path,body", [
    (CHAT, {**CHAT_BASE, "messages": MANY}),
    ("/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": MANY}),
    ("/api/chat", {"model": "tiny", "stream": False, "messages": MANY}),
    ("/v1/responses", {"model": "tiny", "input": [{"role": "user", "content": "hi"}] * 100_000}),
    (CHAT, {**CHAT_BASE, "messages": [{"role": "user", "content": "word " * 780_000}]}),
])
def test_a_huge_prompt_is_refused_before_it_is_rendered(server, alone_text, render_log, path, body):
    r = with_bystander(server, alone_text, post(path, body))
    assert r.status_code == 400, r.text
    assert "context" in r.text and ("messages" in r.text or "characters" in r.text), r.text
    if path == CHAT:
        assert r.json()["error"]["code"] == "context_length_exceeded"
    huge = [c for c in render_log if c[2] > 10_000]
    assert huge == [], huge  # refused by the cheap bounds: never rendered nor tokenized


def test_prompts_are_rendered_and_tokenized_off_the_event_loop(server, alone_text, render_log):
    long_text = "hi " * 1000  # passes the cheap bounds (context 128), then is counted in a worker thread
    r = with_bystander(server, alone_text, post(CHAT, {**CHAT_BASE, "messages": [{"role": "user",
                                                                                  "content": long_text}]}))
    openai_400(r, "messages", "more than", "context")
    r = with_bystander(server, alone_text, post(CHAT, CHAT_BASE))
    assert r.status_code == 200, r.text
    assert {c[0] for c in render_log} == {"render", "tokenize"}
    assert not any(on_loop for _, on_loop, _ in render_log), render_log
    assert not any(what == "tokenize" and chars > 2000 for what, _, chars in render_log), render_log


def test_a_long_text_is_counted_only_until_it_passes_the_context():
    from edgeserve.server.prompt_bounds import COUNT_CHUNK_CHARS, surely_too_long

    class Counting:
        """One token per character; counts what it was asked to tokenize."""

        def __init__(self):
            self.chars = 0
            self.backend = self

        def encode(self, text, add_special_tokens=False):
            self.chars += len(text)
            return type("E", (), {"ids": list(range(len(text)))})()

    tok = Counting()
    assert surely_too_long(tok, "x" * (COUNT_CHUNK_CHARS * 50), context=1000) > 1000
    assert tok.chars == COUNT_CHUNK_CHARS  # one piece told enough: the other 49 were never tokenized
    assert surely_too_long(tok, "x" * 3000, context=1000) == 0  # short enough to tokenize whole: no count


# --- 5. a short request beside a deep prefill: steps bounded by cost ------------------------------------------------

def _synthetic_cost(shape) -> float:
    """Seconds a step 'takes' under the fake clock: a fixed part, per token, and per key attended (deep prompt
    tokens cost more and more)."""
    return 1e-3 + 2e-6 * shape.tokens + 5e-9 * shape.attended


def test_a_short_request_beside_a_deep_prefill_waits_one_bounded_step(tmp_path):
    from edgeserve.engine.sched.step_cost import StepCostModel

    path = write_tiny_llama(tmp_path / "tiny.gguf", context=4096)
    budget = 256
    cfg = ServerConfig(engine=EngineConfig(kv_cache_gb=0.01, max_num_batched_tokens=budget), models=(str(path),),
                       keep_alive=None)
    short = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    long_ids = [3 + (i * 7) % 250 for i in range(3000)]
    with serve(cfg) as s:
        with httpx.Client(base_url=s.url, timeout=120) as c:
            alone = c.post(CHAT, json=short).json()["choices"][0]["message"]["content"]
        sched = s.manager.entries["tiny"].engine.core.scheduler
        now = [0.0]

        def clock() -> float:  # each step lasts exactly its synthetic cost, so the fitted model is exact
            if sched._timing is not None:
                now[0] = sched._timing[2] + _synthetic_cost(sched._timing[1])
            return now[0]

        steps: list[dict[str, tuple[int, int, bool]]] = []  # per step: seq -> (first position, tokens, samples)
        real = sched.schedule

        def schedule():
            out = real()
            # engine request ids are "<X-Request-Id>-<hex>-<choice>"
            steps.append({x.seq_id.split("-")[0]: (x.positions[0], x.num_new_tokens, x.samples)
                          for x in out.scheduled})
            return out

        # the fake clock from here on, and a cost model that never saw the real times of the warm-up request
        sched.clock, sched.step_cost = clock, StepCostModel()
        with httpx.Client(base_url=s.url, timeout=120) as c:  # the short one alone again: shapes of every kind
            assert c.post(CHAT, json=short).json()["choices"][0]["message"]["content"] == alone
        sched.schedule = schedule
        out = anyio.run(_short_during_a_deep_prefill, s.url, long_ids, short, steps)
    assert out["long"].status_code == 200 and out["long"].json()["choices"][0]["finish_reason"] == "length"
    assert out["short"].json()["choices"][0]["message"]["content"] == alone  # the short one is served correctly
    _assert_bounded_steps(steps, budget)


async def _short_during_a_deep_prefill(url: str, long_ids: list[int], short: dict, steps: list[dict]) -> dict:
    """Send the long prompt (request id "long"), then, once `steps` show it 1500 positions deep into its prefill,
    the short chat (id "short"); both responses."""
    out = {}
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        async def long():
            out["long"] = await c.post("/v1/completions", json={"model": "tiny", "prompt": long_ids,
                                                                "max_tokens": 2, "temperature": 0},
                                       headers={"x-request-id": "long"})

        async with anyio.create_task_group() as tg:
            tg.start_soon(long)
            with anyio.fail_after(120):
                while not any(st.get("long", (0, 0, 0))[0] >= 1500 for st in steps):
                    await anyio.sleep(0.01)  # the long prompt is deep into its prefill
            out["short"] = await c.post(CHAT, json=short, headers={"x-request-id": "short"})
    return out


def _assert_bounded_steps(steps: list[dict], budget: int) -> None:
    """The short request's first step computes its whole prompt beside at most one token of the deep one, its first
    token comes first, and the deep prompt's own steps stay within the slowdown cap as their chunks shrink."""
    from edgeserve.engine.sched.step_cost import chunk_shape

    first_short = next(i for i, st in enumerate(steps) if "short" in st)
    assert steps[first_short]["short"][2], "the short prompt is computed whole in its first step"
    assert steps[first_short].get("long", (0, 0))[1] <= 1, "beside a first token the deep prompt takes its floor"
    first_tokens = [k for st in steps for k, v in st.items() if v[2]]
    assert first_tokens.index("short") < first_tokens.index("long")  # the short one is not queued behind it
    cap = 1.5 * _synthetic_cost(chunk_shape(0, budget))  # the default max_decode_slowdown
    deep = [st["long"] for st in steps if set(st) == {"long"} and st["long"][0] >= 1500]
    assert len(deep) > 3
    for start, n, _ in deep:  # alone, the deep prompt's steps cost at most 1.5x a full budget at position 0
        assert _synthetic_cost(chunk_shape(start, n)) <= 1.25 * cap, (start, n)
    assert min(n for start, n, _ in deep) < budget  # and its chunks did shrink with depth
