"""Issue 52 item 13: a per-request thinking budget. After that many reasoning tokens the engine writes the model's
own closing tag and the answer follows: OpenAI `thinking_budget_tokens` / `max_thinking_tokens`, Anthropic
`thinking.budget_tokens` (through the real client libraries), on scripted models whose thought never ends alone."""

from __future__ import annotations

import httpx
import pytest
from scripted_gguf import ANSWER, NEWLINE, THINK_TEMPLATE, write_scripted_gguf
from server_helpers import StepGate, serve, wait_until

from edgeserve.engine.config import EngineConfig
from edgeserve.engine.sched.thinking_budget import ThinkingBudget, ThinkingState
from edgeserve.server import ServerConfig

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

HMM = " hmm"
# the model opens a thought and then thinks forever; after `</think>` it answers
LOOPING = [(NEWLINE, "<think>"), ("<think>", HMM), (HMM, HMM), ("</think>", ANSWER), (ANSWER, "<|im_end|>")]
# the prompt opens the thought (as DeepSeek-R1's template does)
OPENED_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
OPENED = [(NEWLINE, HMM), (HMM, HMM), ("</think>", ANSWER), (ANSWER, "<|im_end|>")]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("budget")
    looping = write_scripted_gguf(d / "looping.gguf", LOOPING, THINK_TEMPLATE, arch="qwen3")
    opened = write_scripted_gguf(d / "opened.gguf", OPENED, OPENED_TEMPLATE, arch="qwen3", specials=("<think>",
                                                                                                   "</think>"))
    with serve(ServerConfig(engine=EngineConfig(max_num_seqs=4, kv_cache_gb=0.05),
                            models=(str(looping), str(opened)), keep_alive=None, max_loaded_models=2)) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(oai, model: str, **extra):
    return oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "2+2?"}], max_tokens=40,
                                       extra_body={**GREEDY, **extra})


@pytest.mark.parametrize("model", ["looping", "opened"])
def test_without_a_budget_the_thought_runs_to_max_tokens(oai, model):
    r = chat(oai, model)
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.content


@pytest.mark.parametrize("model", ["looping", "opened"])
@pytest.mark.parametrize("field", ["thinking_budget_tokens", "max_thinking_tokens"])
def test_openai_budget_closes_the_thought_and_the_answer_follows(oai, model, field):
    r = chat(oai, model, **{field: 5})
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop", r
    assert msg.content.strip() == ANSWER
    assert msg.model_extra["reasoning_content"].strip() == (HMM * 5).strip()


def test_openai_budget_streams(oai):
    stream = oai.chat.completions.create(model="looping", messages=[{"role": "user", "content": "2+2?"}],
                                         max_tokens=40, stream=True,
                                         extra_body={**GREEDY, "thinking_budget_tokens": 3})
    reasoning, content, finish = "", "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert reasoning.strip() == (HMM * 3).strip() and content.strip() == ANSWER and finish == "stop"


def test_a_zero_budget_answers_at_once(oai):
    r = chat(oai, "looping", thinking_budget_tokens=0)
    assert r.choices[0].message.content.strip() == ANSWER
    assert not (r.choices[0].message.model_extra.get("reasoning_content") or "").strip()


@pytest.mark.parametrize("body, field", [({"thinking_budget_tokens": -1}, "thinking_budget_tokens"),
                                         ({"max_thinking_tokens": 1.5}, "max_thinking_tokens"),
                                         ({"thinking_budget_tokens": 3, "max_thinking_tokens": 4},
                                          "max_thinking_tokens")])
def test_bad_budgets_are_400(oai, body, field):
    with pytest.raises(openai.BadRequestError) as e:
        chat(oai, "looping", **body)
    assert e.value.body["param"] == field


def test_anthropic_budget_tokens_is_a_budget(server):
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    msg = claude.messages.create(model="looping", max_tokens=40, extra_body={"temperature": 0, "top_k": 1},
                                 thinking={"type": "enabled", "budget_tokens": 4},
                                 messages=[{"role": "user", "content": "2+2?"}])
    kinds = [b.type for b in msg.content]
    assert kinds == ["thinking", "text"] and msg.stop_reason == "end_turn", msg
    assert msg.content[0].thinking.strip() == (HMM * 4).strip() and msg.content[1].text.strip() == ANSWER


def test_thinking_state_counts_from_the_opening_tag_and_stops_at_the_models_own_close():
    spec = ThinkingBudget(2, close_ids=(9, 10), open_ids=(7,))
    s = ThinkingState(spec)
    s.accept([7])  # the model opens its thought
    assert s.forced() is None
    s.accept([1, 2])
    assert s.forced() == 9
    s.accept([9])
    assert s.forced() == 10
    s.accept([10])
    assert s.forced() is None and s.done
    closes_itself = ThinkingState(ThinkingBudget(5, close_ids=(9,), in_thought=True))
    closes_itself.accept([1, 9, 1, 1, 1, 1, 1, 1])
    assert closes_itself.done and closes_itself.forced() is None
    answers = ThinkingState(ThinkingBudget(1, close_ids=(9,), open_ids=(7,)))
    answers.accept([1, 2, 3, 4, 5, 6])  # no thought at the reply's start: never forced
    assert answers.done and answers.forced() is None


def test_end_now_closes_a_running_thought_and_a_resumed_state_replays_the_output():
    s = ThinkingState(ThinkingBudget(100, close_ids=(9, 10), open_ids=(7,)))
    s.accept([7, 1, 1])
    assert s.forced() is None and s.end_now()
    assert s.forced() == 9  # the closing tag at the next step, the budget notwithstanding
    s.accept([9, 10])
    assert s.done and s.forced() is None and not s.end_now()
    spec = ThinkingBudget(2**31 - 1, close_ids=(9,), open_ids=(7,))
    assert ThinkingState.resume(spec, [7, 1, 1]).end_now()  # still thinking
    assert not ThinkingState.resume(spec, [7, 1, 9, 4]).end_now()  # already answering
    before_open = ThinkingState.resume(spec, [])
    assert before_open.end_now() and before_open.forced() is None  # nothing to close until the thought opens
    before_open.accept([7])
    assert before_open.forced() == 9


def _gate(server):
    return StepGate(server.manager.entries["looping"].engine.core)


def test_end_thinking_now_through_the_openai_client(server, oai):
    """A chat stream thinking forever: POST /v1/requests/{X-Request-Id}/end_thinking closes the thought and the
    answer follows in the same stream."""
    chat(oai, "looping", max_tokens=1)  # loaded
    gate = _gate(server)
    try:
        gate.allow(5)  # the opening tag and a few thoughts, then the steps wait
        stream = oai.chat.completions.create(model="looping", messages=[{"role": "user", "content": "2+2?"}],
                                             max_tokens=300, stream=True, extra_body=GREEDY,
                                             extra_headers={"X-Request-Id": "think-now-1"})
        reasoning, content, finish, ended = "", "", None, None
        for chunk in stream:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
            if ended is None and reasoning.count(HMM) >= 2:
                ended = httpx.post(f"{server.url}/v1/requests/think-now-1/end_thinking").json()
                gate.open()
    finally:
        gate.restore()
    assert ended == {"id": "think-now-1", "object": "thinking.end", "ended": 1}
    assert content.strip() == ANSWER and finish == "stop"
    assert 2 <= reasoning.count(HMM) <= 8  # not the 300 tokens it would think
    missing = httpx.post(f"{server.url}/v1/requests/think-now-1/end_thinking")  # it has finished
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "id"


def test_end_thinking_of_a_background_response_by_its_id(server, oai):
    oai.chat.completions.create(model="looping", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    gate = _gate(server)
    try:
        r = oai.responses.create(model="looping", input="2+2?", max_output_tokens=300, background=True,
                                 temperature=0)
        assert gate.waiting.wait(30)
        ended = httpx.post(f"{server.url}/v1/responses/{r.id}/end_thinking").json()
        gate.open()
        assert ended["ended"] == 1
        assert wait_until(lambda: oai.responses.retrieve(r.id).status == "completed", timeout=60)
    finally:
        gate.restore()
    done = oai.responses.retrieve(r.id)
    # ended before its first step: the thought closes as soon as the model opens it, and the answer follows
    assert done.output[-1].type == "message" and done.output_text.strip() == ANSWER
    assert done.usage.output_tokens < 10


def test_end_thinking_of_an_anthropic_stream_by_its_message_id(server):
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    claude.messages.create(model="looping", max_tokens=1, messages=[{"role": "user", "content": "hi"}])  # loaded
    gate = _gate(server)
    try:
        gate.allow(5)
        thinking, text, ended = "", "", None
        with claude.messages.stream(model="looping", max_tokens=300, extra_body={"temperature": 0, "top_k": 1},
                                    thinking={"type": "enabled", "budget_tokens": 1024},
                                    messages=[{"role": "user", "content": "2+2?"}]) as s:
            for event in s:
                if event.type == "message_start":
                    mid = event.message.id
                elif event.type == "content_block_delta" and event.delta.type == "thinking_delta":
                    thinking += event.delta.thinking
                    if ended is None and thinking.count(HMM) >= 2:
                        ended = httpx.post(f"{server.url}/v1/requests/{mid}/end_thinking").json()
                        gate.open()
                elif event.type == "content_block_delta" and event.delta.type == "text_delta":
                    text += event.delta.text
            final = s.get_final_message()
    finally:
        gate.restore()
    assert ended["ended"] == 1 and text.strip() == ANSWER and final.stop_reason == "end_turn"
    assert 2 <= thinking.count(HMM) <= 8
