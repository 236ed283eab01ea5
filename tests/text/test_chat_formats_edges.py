"""Reply reading at the edges llama.cpp's chat-parser expectations cover: stop strings as the engine applies them
(the reference harness), a thought the model opens after the prompt closed one, MiniMax-M1's `<think>`,
reasoning_format "none" on Ling 3 / Kimi K3 (tags off, text kept) and gpt-oss (the analysis message as written),
Apriel 1.6's prompt-opened reasoning prose, firefunction v2's `functions` / `datetime` variables, calls cut short
by max_tokens (ChatFormat.cut), and own cases storing json_schema as an object."""

from __future__ import annotations

import datetime
import json

import pytest

from chat_format_cases import build_request, engine_deltas, run_case
from edgeserve.server.chat_setup import chat_setup
from edgeserve.text.formats.base import CallContext
from edgeserve.text.formats.cut_call import pythonic_arguments, tail_cut
from edgeserve.text.stop import StopMatcher
from test_chat_formats import WEATHER, _read, _setup, _template, _whole_and_streamed


# --- the harness: stop strings as the engine applies them ----------------------------------------------------------

def test_harness_ends_the_reply_at_the_first_stop_string_without_its_text():
    stops = StopMatcher(["<|role_end|>", "</assistant>"])
    assert engine_deltas(["It is noon.</assis", "tant>more<|role_end|>"], stops, "length") == [
        ("It is noon.", None), ("", "stop")]
    assert engine_deltas(["Hi", " there"], StopMatcher(["<|role_end|>"]), "length") == [
        ("Hi", None), (" there", "length")]
    assert engine_deltas(["Hi <|role", "_x"], StopMatcher(["<|role_end|>"]), "stop") == [
        ("Hi ", None), ("<|role_x", "stop")]  # a held start that never completes is text


@pytest.mark.parametrize("template, reply", [("inclusionai-ling-3.0-flash.jinja", "Here is the answer.<|role_end|>"),
                                             ("poolside-Laguna-S-2.1.jinja", "Here is the answer.</assistant>x")])
def test_harness_reply_stops_at_the_format_stop(template, reply):
    case = {"template": template, "input": reply, "enable_thinking": False}
    assert run_case(case)[0].strip() == "Here is the answer."


def test_harness_reads_json_schema_as_text_or_object():
    schema = {"type": "object", "properties": {"a": {"type": "number"}}}
    case = {"template": "Qwen-Qwen2.5-7B-Instruct.jinja"}
    as_text = build_request({**case, "json_schema": json.dumps(schema)}).constraint
    assert as_text is not None and as_text == build_request({**case, "json_schema": schema}).constraint


# --- thoughts ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("template, reply", [
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use", "<|START_THINKING|>Need it.<|END_THINKING|><|START_RESPONSE|>"
                                                      "Done.<|END_RESPONSE|>"),
    ("tencent-Hy3", "<think:opensource>Need it.</think:opensource>Done."),
])
def test_a_thought_opened_after_the_prompt_closed_one_is_reasoning(template, reply):
    setup = _setup(_template(template))
    assert setup.prompt.rstrip().endswith(setup.tags[1]) and not setup.in_thought  # the prompt closed a thought
    assert _whole_and_streamed(setup, reply)[:2] == ("Need it.", "Done.")


def test_a_constraint_after_a_closed_thought_starts_at_once():
    setup = _setup(_template("CohereForAI-c4ai-command-r7b-12-2024-tool_use"), tools=[WEATHER],
                   tool_choice="required")
    assert setup.constraint is not None and setup.constraint.think is None


def test_minimax_m1_thinks_in_think_tags():
    setup = _setup(_template("MiniMax-M1"), tools=[WEATHER])
    reply = ('<think>Weather.</think>\n<tool_calls>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
             "</tool_calls>")
    assert _whole_and_streamed(setup, reply) == ("Weather.", "", [("get_weather", {"city": "Oslo"})], "tool_calls")


def test_apriel_16_reasoning_starts_with_the_prose_the_prompt_opened():
    setup = _setup(_template("Apriel-1.6-15b-Thinker-fixed"), think=True)
    assert setup.in_thought
    reply = "I'm\nthinking\n[BEGIN FINAL RESPONSE]\nHello"
    assert _whole_and_streamed(setup, reply)[:2] == ("Here are my reasoning steps:\nI'm\nthinking", "Hello")


def test_reasoning_format_none_on_ling3_and_kimi_k3_keeps_the_thought_text_without_tags():
    ling = _setup(_template("inclusionai-ling-3.0-flash"), think=True, reasoning_format="none", tools=[WEATHER])
    reply = ("Need weather.\n</think>\nSure.<tool_call>get_weather\n<arg_key>city</arg_key>\n"
             "<arg_value>Paris</arg_value>\n</tool_call>")
    assert _whole_and_streamed(ling, reply) == ("", "Need weather.\n\nSure.", [("get_weather", {"city": "Paris"})],
                                                "tool_calls")
    kimi = _setup(_template("Kimi-K3"), think=True, reasoning_format="none")
    reply = "Hmm<|close|>think<|sep|><|open|>response<|sep|>Hi<|close|>response<|sep|><|close|>message<|sep|>"
    assert _whole_and_streamed(kimi, reply) == ("", "HmmHi", [], "stop")


def test_reasoning_format_none_on_gpt_oss_returns_the_analysis_message_as_written():
    setup = _setup(_template("openai-gpt-oss-120b"), reasoning_format="none")
    reply = "<|channel|>analysis<|message|>Hmm<|end|><|start|>assistant<|channel|>final<|message|>Hi"
    assert _whole_and_streamed(setup, reply) == ("", "<|channel|>analysis<|message|>Hmm<|end|>Hi", [], "stop")
    assert _read(_setup(_template("openai-gpt-oss-120b")), [reply])[:2] == ("Hmm", "Hi")


# --- firefunction v2's template variables --------------------------------------------------------------------------

def test_firefunction_gets_its_functions_and_datetime():
    t = _template("fireworks-ai-llama-3-firefunction-v2")
    prompt = _setup(t, tools=[WEATHER]).prompt
    assert json.dumps([WEATHER]) in prompt
    assert "Today is " + datetime.date.today().strftime("%b %d %Y") + "." in prompt
    assert "<tool_call>" not in prompt  # no generic tools block: the template lists them itself
    assert "Available functions as JSON spec:\n\nToday is" in _setup(t).prompt  # renders without tools
    assert "Today is Jan 01 2000." in _setup(t, template_kwargs={"datetime": "Jan 01 2000"}).prompt
    reply = ' functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    assert _whole_and_streamed(_setup(t, tools=[WEATHER]), reply)[2] == [("get_weather", {"city": "Paris"})]


def test_firefunction_renders_earlier_calls_natively():
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "a", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "a", "content": "21"}]
    prompt = _setup(_template("fireworks-ai-llama-3-firefunction-v2"), tools=[WEATHER], messages=messages).prompt
    assert ' functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]' in prompt


# --- calls cut short by max_tokens ---------------------------------------------------------------------------------

def _cut(setup, text: str):
    parser = setup.parser()
    from edgeserve.engine.outputs import RequestOutput

    out = RequestOutput("r", text, [], None, "length")
    setup.split(parser, out)
    return out.text, [(c.name, c.arguments, c.id) for c in out.tool_calls], out.finish_reason


SPECIAL = {"type": "function", "function": {"name": "special_function", "parameters": {
    "type": "object", "properties": {"arg1": {"type": "integer"}}, "required": ["arg1"]}}}


@pytest.mark.parametrize("template, reply, args, call_id", [
    ("LFM2-8B-A1B", "<|tool_call_start|>[special_function(arg1=", '{"arg1": ', None),
    ("Kimi-K2-Thinking", "<|tool_calls_section_begin|><|tool_call_begin|>functions.special_function:0"
                         '<|tool_call_argument_begin|>{"arg1": ', '{"arg1": ', "functions.special_function:0"),
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use",
     '<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "special_function", ', "", "0"),
    ("Cohere2MoE", '<|END_THINKING|><|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "special_function", '
                   '"parameters": {"a', '{"a', "0"),  # its prompt opened the thought
    ("Reka-Edge", '<tool_call>\n{"name": "special_function", "arguments": {"arg1":', '{"arg1":', None),
])
def test_a_call_cut_by_max_tokens_comes_back_with_its_arguments_so_far(template, reply, args, call_id):
    setup = _setup(_template(template), tools=[SPECIAL])
    content, calls, finish = _cut(setup, reply)
    assert content == "" and finish == "length"
    assert [(n, a) for n, a, _ in calls] == [("special_function", args)]
    if call_id is not None:
        assert calls[0][2] == call_id
    # the same text ending the turn ("stop") is a malformed call: content, as before
    assert _read(setup, [reply])[1:3] == (reply.replace("<|END_THINKING|>", ""), [])


def test_a_cut_call_to_a_function_not_offered_stays_content():
    setup = _setup(_template("LFM2-8B-A1B"), tools=[SPECIAL])
    assert _cut(setup, "<|tool_call_start|>[other(arg1=") == ("<|tool_call_start|>[other(arg1=", [], "length")


def test_cut_readers():
    read = tail_cut(r"<c>(?P<name>\w+):(?P<args>.*)")
    assert [(c.name, c.arguments) for c in read("<c>f:{\"a", CallContext({"f"}))] == [("f", '{"a')]
    assert read("text", CallContext({"f"})) == []
    assert pythonic_arguments("a=1, b='x', c=") == "{\"a\": 1, \"b\": 'x', \"c\": "


# --- call arguments as the template takes them ---------------------------------------------------------------------

CALL_HISTORY = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "a1b2c3d4e", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "21"}]


def test_a_template_that_concatenates_arguments_gets_them_as_text():
    v32 = _template("meetkai-functionary-medium-v3.2")
    assert not v32.accepts_object_arguments()
    assert '>>>get_weather\n{"city": "Paris"}' in _setup(v32, tools=[WEATHER], messages=CALL_HISTORY).prompt
    qwen = _template("Qwen-Qwen2.5-7B-Instruct")  # HF templates take an object (tojson of it)
    assert qwen.accepts_object_arguments()
    assert '"arguments": {"city": "Paris"}' in _setup(qwen, tools=[WEATHER], messages=CALL_HISTORY).prompt
