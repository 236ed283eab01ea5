"""Harmony (gpt-oss): prompts against the reference renderings (openai/harmony's documented output and the official
chat template, tests/gpt_oss_chat_template.jinja), replies parsed whole and streamed at every split, the
harmony-framed grammars, reasoning effort from every API, and tiny scripted harmony models through the four chat
routes (OpenAI chat, Ollama /api/chat, Anthropic /v1/messages, OpenAI /v1/responses)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from edgeserve.engine.config import EngineConfig
from edgeserve.errors import ChatTemplateError
from edgeserve.loaders.chat_template import ChatTemplate
from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.loaders.tokenizer import tokenizer_from_gguf
from edgeserve.server import ServerConfig
from edgeserve.server.api.anthropic import parse_messages_request
from edgeserve.server.api.ollama import parse_ollama_chat
from edgeserve.server.api.openai import parse_chat_request
from edgeserve.server.api.responses import parse_responses_request
from edgeserve.server.chat_setup import chat_setup
from edgeserve.text.grammar import GrammarCompiler, GrammarSpec, allowed_mask, json_rule
from edgeserve.text.harmony import (MARKERS, HarmonyOptions, HarmonyParser, reasoning_effort, render_harmony,
                                    template_is_harmony, tool_call_grammar, tools_namespace)
from edgeserve.text.tool_calls import messages_for_template
from scripted_gguf import write_scripted_gguf
from server_helpers import post_api, serve

TEMPLATE_SOURCE = (Path(__file__).parents[1] / "gpt_oss_chat_template.jinja").read_text()
DATE = "2025-06-28"
OFFICIAL = ChatTemplate(TEMPLATE_SOURCE)
OFFICIAL._template.globals["strftime_now"] = lambda fmt: DATE  # this template object only: a fixed date
SPECIALS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")

CITY = {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
        "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": CITY}}
PARIS = {"city": "Paris"}


def official(messages, tools=None, **kw) -> str:
    """The official template's rendering of `messages` as edgeserve hands them to a Jinja template (call arguments
    as objects; reasoning in `thinking`, where this template reads it), on the fixed date."""
    msgs = [{("thinking" if k == "reasoning_content" else k): v for k, v in m.items()}
            for m in messages_for_template(messages, tools, TEMPLATE_SOURCE)]
    return OFFICIAL.render(msgs, add_generation_prompt=True, tools=tools, **kw)


def ours(messages, tools=None, effort="medium", **kw) -> str:
    return render_harmony(messages, tools, HarmonyOptions(effort, current_date=DATE, **kw))


# --- rendering ---------------------------------------------------------------------------------------------------

def test_detects_harmony_templates():
    assert template_is_harmony(TEMPLATE_SOURCE)
    assert not template_is_harmony("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")


def test_matches_the_reference_renderer():
    """openai/harmony's test_render_functions_with_parameters, byte for byte (its four functions, a kitchen sink
    of schema features among them)."""
    weather_props = {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}
    tools = [
        {"type": "function", "function": {"name": "get_location", "description": "Gets the location of the user."}},
        {"type": "function", "function": {
            "name": "get_current_weather", "description": "Gets the current weather in the provided location.",
            "parameters": {"type": "object", "properties": {
                "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
                "format": weather_props}, "required": ["location"]}}},
        {"type": "function", "function": {
            "name": "get_multiple_weathers",
            "description": "Gets the current weather in the provided list of locations.",
            "parameters": {"type": "object", "properties": {
                "locations": {"type": "array", "items": {"type": "string"},
                              "description": 'List of city and state, e.g. ["San Francisco, CA", "New York, NY"]'},
                "format": weather_props}, "required": ["locations"]}}},
        {"type": "function", "function": {
            "name": "kitchensink", "description": "A function with various complex schemas.",
            "parameters": {"description": "params object", "type": "object", "properties": {
                "string": {"type": "string", "title": "STRING", "description": "A string",
                           "examples": ["hello", "world"]},
                "string_nullable": {"type": "string", "nullable": True, "description": "A nullable string",
                                    "default": "the default"},
                "string_enum": {"type": "string", "enum": ["a", "b", "c"]},
                "oneof_string_or_number": {"oneOf": [{"type": "string", "default": "default_string_in_oneof"},
                                                     {"type": "number", "description": "numbers can happen too"}],
                                           "description": "a oneof", "default": 20}}}}},
    ]
    messages = [{"role": "system", "content": "Always respond in riddles"},
                {"role": "user", "content": "What is the weather like in SF?"}]
    expected = (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n\nReasoning: high\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
        "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nAlways respond in riddles\n\n# Tools\n\n## functions\n\n"
        "namespace functions {\n\n"
        "// Gets the location of the user.\ntype get_location = () => any;\n\n"
        "// Gets the current weather in the provided location.\ntype get_current_weather = (_: {\n"
        "// The city and state, e.g. San Francisco, CA\nlocation: string,\n"
        'format?: "celsius" | "fahrenheit", // default: celsius\n}) => any;\n\n'
        "// Gets the current weather in the provided list of locations.\ntype get_multiple_weathers = (_: {\n"
        '// List of city and state, e.g. ["San Francisco, CA", "New York, NY"]\nlocations: string[],\n'
        'format?: "celsius" | "fahrenheit", // default: celsius\n}) => any;\n\n'
        "// A function with various complex schemas.\ntype kitchensink = (_: // params object\n{\n"
        '// STRING\n//\n// A string\n// Examples:\n// - "hello"\n// - "world"\nstring?: string,\n'
        '// A nullable string\nstring_nullable?: string | null, // default: "the default"\n'
        'string_enum?: "a" | "b" | "c",\n'
        "// a oneof\n// default: 20\noneof_string_or_number?:\n"
        ' | string // default: "default_string_in_oneof"\n | number // numbers can happen too\n,\n}) => any;\n\n'
        "} // namespace functions<|end|><|start|>user<|message|>What is the weather like in SF?<|end|>"
        "<|start|>assistant")
    assert ours(messages, tools, "high") == expected


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
RESULT = '{"temp": 18, "sky": "sunny"}'
CONVERSATIONS = {
    "user only": [{"role": "user", "content": "Hi"}],
    "multi-turn, earlier reasoning dropped": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Simple."}, {"role": "user", "content": "3+3?"}],
    "tools": [{"role": "developer", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"}],
    "tool result, reasoning kept": [
        {"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [CALL]},
        {"role": "tool", "content": RESULT, "tool_call_id": "call_1"}],
    "answered call, reasoning dropped": [
        {"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [CALL]},
        {"role": "tool", "content": RESULT, "tool_call_id": "call_1"},
        {"role": "assistant", "content": "Sunny, 18 C."}, {"role": "user", "content": "And tomorrow?"}],
}


def _without_template_quirks(text: str, instructions: str) -> str:
    """The official template's rendering with its two documented departures from harmony undone: tool results
    JSON-quoted, and a blank line closing a developer message that has instructions but no tools."""
    text = text.replace(json.dumps(RESULT), RESULT)
    return text.replace(f"# Instructions\n\n{instructions}\n\n<|end|>", f"# Instructions\n\n{instructions}<|end|>")


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("effort", ["low", "high"])
def test_matches_the_official_template(name, effort):
    """Byte for byte, but for the documented differences (test_where_the_official_template_strays_from_the_reference
    shows each)."""
    messages = CONVERSATIONS[name]
    tools = [WEATHER] if "tool" in name else None
    first = messages[0]["content"] if messages[0]["role"] in ("system", "developer") else ""
    want = _without_template_quirks(official(messages, tools, reasoning_effort=effort), first)
    got = ours(messages, tools, effort)
    assert got == want
    assert f"Reasoning: {effort}\n" in got and got.endswith("<|start|>assistant")
    if "tool result" in name:
        assert f"commentary<|message|>{RESULT}<|end|>" in got and "<|channel|>analysis<|message|>Need the tool." in got
    if "dropped" in name:
        assert "Simple." not in got and "Need the tool." not in got


def test_model_identity_matches_the_official_template():
    msgs = CONVERSATIONS["user only"]
    assert ours(msgs, model_identity="You are Edgy.") == official(msgs, model_identity="You are Edgy.")


def test_parallel_calls_each_get_a_message_and_their_results_are_named():
    """The official template renders only the first call (and names every result after it): harmony writes one
    message per call, and each result names the function its tool_call_id points at."""
    calls = [CALL, {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}}]
    got = ours([{"role": "user", "content": "Weather and time?"},
                {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
                {"role": "tool", "content": "10:00", "tool_call_id": "call_2"}], [WEATHER])
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
            '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": "CET"}<|call|>'
            "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>18 C<|end|>"
            "<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>10:00<|end|>") in got
    with pytest.raises(ChatTemplateError, match="tool message"):
        ours([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}])


def test_where_the_official_template_strays_from_the_reference():
    """Template quirks edgeserve does not copy (it follows openai/harmony's renderer, as
    test_matches_the_reference_renderer checks): a comma after a defaulted parameter's `// default:` comment, a
    blank line closing a developer message that has instructions but no tools (harmony's docs/format.md: `#
    Instructions\n\n{instructions}<|end|>`), JSON-quoted tool results. A developer message with tools but no
    instructions opens with `# Tools` in both now (the template's earlier revision opened it with a blank line)."""
    unit = {"type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"], "default": "c"}}}
    tool = {"type": "function", "function": {"name": "t", "description": "T", "parameters": unit}}
    line = 'unit?: "c" | "f", // default: c'
    assert f"{line}\n" in tools_namespace([tool])
    template = official([{"role": "user", "content": "x"}], [tool])
    assert f"{line},\n" in template and "<|start|>developer<|message|># Tools" in template
    assert "<|start|>developer<|message|># Tools" in ours([{"role": "user", "content": "x"}], [tool])
    brief = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}]
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|>" in official(brief)
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.<|end|>" in ours(brief)
    result = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
              {"role": "tool", "content": RESULT, "tool_call_id": "call_1"}]
    assert f"<|message|>{json.dumps(RESULT)}<|end|>" in official(result, [WEATHER])
    assert f"<|message|>{RESULT}<|end|>" in ours(result, [WEATHER])


def test_instructions_alone_match_the_reference_renderer():
    """openai/harmony's test_simple_convo_high_effort (its test-data file), byte for byte but for the current date
    (edgeserve, like the template, always writes one): a developer message with instructions and no tools ends
    right after them."""
    messages = [{"role": "system", "content": "Answer the user's questions like a robot."},
                {"role": "user", "content": "What is the capital of the largest country in the world?"}]
    expected = ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
                "Knowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n\nReasoning: high\n\n"
                "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
                "<|start|>developer<|message|># Instructions\n\nAnswer the user's questions like a robot.<|end|>"
                "<|start|>user<|message|>What is the capital of the largest country in the world?<|end|>"
                "<|start|>assistant")
    assert ours(messages, effort="high") == expected


# --- parsing replies -----------------------------------------------------------------------------------------------

THOUGHT, ANSWER = "User asks 2+2 – “simple”.", "2 + 2 = 4 ✓"
REPLIES = {
    "reasoning then answer": (f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>final"
                              f"<|message|>{ANSWER}", THOUGHT, ANSWER, []),
    "call on the channel": (f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>commentary"
                            ' to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}', THOUGHT, "",
                            [("get_weather", '{"city":"Paris"}')]),
    "call in the role": (' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
                         "", "", [("get_weather", '{"city": "Paris"}')]),
    "preamble is content": ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary"
                            ' to=functions.get_weather <|constrain|>json<|message|>{"city":"Rome"}', "", "Checking.",
                            [("get_weather", '{"city":"Rome"}')]),
    "unknown function is text": ('<|channel|>commentary to=functions.launch <|constrain|>json<|message|>{"at": 1}',
                                 "", '{"at": 1}', []),
    "built-in tool is dropped": ('<|channel|>analysis<|message|>Search.<|end|><|start|>assistant<|channel|>analysis'
                                 ' to=browser.search code<|message|>{"query": "x"}<|call|>', "Search.", "", []),
    "answer only, ended": (f"<|channel|>final<|message|>{ANSWER}<|return|>ignored", "", ANSWER, []),
    "missing <|end|>": (f"<|channel|>analysis<|message|>{THOUGHT}<|start|>assistant<|channel|>final<|message|>{ANSWER}",
                        THOUGHT, ANSWER, []),
    "not harmony at all": ("Just text.", "", "Just text.", []),
    "stray markers in a body": (f"<|channel|>final<|message|>{ANSWER}<|constrain|><|message|>!", "", ANSWER + "!", []),
    "cut inside a header": (f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|chan", THOUGHT, "",
                            []),
}


def _parse(pieces: list[str], known=frozenset({"get_weather"})) -> tuple[str, str, list[tuple[str, str]]]:
    parser = HarmonyParser(set(known))
    reasoning = content = ""
    for piece in pieces:
        r, c = parser.push(piece)
        reasoning, content = reasoning + r, content + c
    r, c, calls = parser.finish()
    return reasoning + r, content + c, [(call.name, call.arguments) for call in calls]


@pytest.mark.parametrize("name", REPLIES)
def test_parses_whole_and_streamed_at_every_split(name):
    text, thought, answer, calls = REPLIES[name]
    want = (thought, answer, calls)
    assert _parse([text]) == want
    assert _parse(list(text)) == want  # one character at a time: every token boundary is among these
    for i in range(1, len(text)):
        assert _parse([text[:i], text[i:]]) == want, f"split at {i}: {text[:i]!r} | {text[i:]!r}"


# llama.cpp's gpt-oss expectations (tests/test-chat.cpp, its openai-gpt-oss-120b.jinja block; the line each starts
# on): model text -> (reasoning, content, calls). Left out: the reasoning_format "none" case (edgeserve always
# splits harmony) and the two continue_final_message cases (no API here continues a prefilled message).
HELLO, THINKING, ARG1 = "Hello, world!\nWhat's up?", "I'm\nthinking", '{"arg1": 1}'
EDIT_ARGS = '{"oldString": "if (part < railCount - 1) {", "newString": "if (part < 4) {", "replaceAll": false}'
PY_HELLO = "I will execute python to say hello"
LLAMA_CPP_CASES = {
    6428: (f"<|channel|>final<|message|>{HELLO}", "", HELLO, []),
    6431: (f"<|channel|>commentary<|message|>{HELLO}", "", HELLO, []),
    6434: (f"<|channel|>analysis<|message|>{THINKING}<|end|><|start|>assistant<|channel|>final<|message|>{HELLO}",
           THINKING, HELLO, []),
    6450: (f"<|channel|>analysis<|message|>{THINKING}", THINKING, "", []),
    6457: (f" to=functions.special_function<|channel|>analysis<|message|>{ARG1}", "", "", [("special_function", ARG1)]),
    6464: (f"<|channel|>analysis to=functions.special_function<|message|>{ARG1}", "", "",
           [("special_function", ARG1)]),
    6471: (f" to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>{ARG1}", "", "",
           [("special_function", ARG1)]),
    6478: (f"<|channel|>commentary to=functions.special_function<|message|>{ARG1}", "", "",
           [("special_function", ARG1)]),
    6485: (f"<|channel|>analysis<|message|>{THINKING}<|end|>"
           f"<|start|>assistant to=functions.special_function<|channel|>analysis<|message|>{ARG1}", THINKING, "",
           [("special_function", ARG1)]),
    6494: ("<|channel|>analysis<|message|>Thinking about edit...<|end|><|start|>assistant<|channel|>commentary "
           f"to=functions.edit <|constrain|>json<|message|>{EDIT_ARGS}", "Thinking about edit...", "",
           [("edit", EDIT_ARGS)]),
    6531: ('<|channel|>analysis<|message|>I need to output the invoice details in JSON<|end|><|start|>assistant'
           '<|channel|>final <|constrain|>json<|message|>{"amount": 123.45, "date": "2025-12-03"}',
           "I need to output the invoice details in JSON", '{"amount": 123.45, "date": "2025-12-03"}', []),
    # messages to built-in tools: neither the answer nor the thought
    6547: (f"<|channel|>analysis<|message|>{PY_HELLO}<|end|><|start|>assistant to=container.exec<|channel|>commentary"
           "<|message|>python3 -c 'print(\"hello\")'", PY_HELLO, "", []),
    6556: (f"<|channel|>analysis<|message|>{PY_HELLO}<|end|><|start|>assistant<|channel|>commentary to=python "
           '<|constrain|>code<|message|>print("hello")', PY_HELLO, "", []),
    # a header that names a channel twice: the last one counts
    6567: (f"<|channel|>commentary to=assistant<|channel|>analysis<|message|>{THINKING}<|end|><|start|>assistant"
           f"<|channel|>final<|message|>{HELLO}", THINKING, HELLO, []),
    6575: (f"<|channel|>analysis<|message|>{THINKING}<|end|><|start|>assistant<|channel|>commentary to=assistant"
           f"<|channel|>final<|message|>{HELLO}", THINKING, HELLO, []),
}


@pytest.mark.parametrize("line", LLAMA_CPP_CASES)
def test_llama_cpp_expectations_whole_and_streamed(line):
    """Each gpt-oss reply llama.cpp's parser tests check, whole, one character at a time and split in two
    everywhere; the tools offered are the ones those tests declare."""
    text, thought, answer, calls = LLAMA_CPP_CASES[line]
    known = {"special_function", "edit"}
    want = (thought, answer, calls)
    assert _parse([text], known) == want
    assert _parse(list(text), known) == want
    for i in range(1, len(text)):
        assert _parse([text[:i], text[i:]], known) == want, f"split at {i}"


def test_llama_cpp_cases_are_the_reference_ones():
    """The table above quotes test-chat.cpp: each case's text is the one its line passes to `tst.test(`."""
    from chat_cpp_inputs import input_at

    for line, (text, *_) in LLAMA_CPP_CASES.items():
        assert input_at(line) == text, line


def test_streamed_text_is_final_and_never_shows_a_marker():
    text = REPLIES["reasoning then answer"][0]
    parser = HarmonyParser()
    shown = []
    for ch in text:
        shown += [s for s in parser.push(ch) if s]
    assert "".join(shown) == THOUGHT + ANSWER  # streamed as it came, nothing held back to the end
    assert not any(m in s for s in shown for m in MARKERS)
    assert parser.finish() == ("", "", [])


def test_parallel_off_keeps_the_first_call():
    two = ('<|channel|>commentary to=functions.get_weather json<|message|>{"city": "A"}<|end|>'
           '<|start|>assistant<|channel|>commentary to=functions.get_weather json<|message|>{"city": "B"}')
    p = HarmonyParser({"get_weather"}, parallel=False)
    p.push(two)
    assert [c.arguments for c in p.finish()[2]] == ['{"city": "A"}']
    assert _parse([two])[2] == [("get_weather", '{"city": "A"}'), ("get_weather", '{"city": "B"}')]


# --- reasoning effort ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, level", [
    (None, None), (True, None), (False, "low"), ("low", "low"), ("medium", "medium"), ("HIGH", "high"),
    ("none", "low"), ("minimal", "low"), ("xhigh", "high"), ("max", "high"), (1024, "low"), (8000, "medium"),
    (32000, "high"), ("turbo", None)])
def test_reasoning_effort_levels(value, level):
    assert reasoning_effort(value) == level


ASK = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("parse, body, level", [
    (lambda b: parse_chat_request(b, 4), {"reasoning_effort": "high"}, "high"),
    (lambda b: parse_chat_request(b, 4), {"chat_template_kwargs": {"reasoning_effort": "low"}}, "low"),
    (lambda b: parse_chat_request(b, 4), {}, "medium"),
    (parse_ollama_chat, {"think": "high"}, "high"),
    (parse_ollama_chat, {"think": False}, "low"),
    (parse_ollama_chat, {"think": True}, "medium"),
    (parse_responses_request, {"reasoning": {"effort": "low"}}, "low"),
    (parse_responses_request, {"reasoning": {"effort": "xhigh"}}, "high"),
    (parse_messages_request, {"thinking": {"type": "enabled", "budget_tokens": 20000}}, "high"),
    (parse_messages_request, {"thinking": {"type": "enabled", "budget_tokens": 1024}}, "low"),
    (parse_messages_request, {"output_config": {"effort": "medium"}, "thinking": {"type": "disabled"}}, "medium"),
    (parse_messages_request, {"thinking": {"type": "disabled"}}, "low"),
])
def test_every_api_sets_the_reasoning_level(parse, body, level):
    prompt = {"input": "Hi"} if parse is parse_responses_request else {"messages": ASK}
    extra = {"max_tokens": 8} if parse is parse_messages_request else {}
    req = parse({"model": "m", **prompt, **extra, **body})
    assert f"\n\nReasoning: {level}\n\n" in chat_setup(req, OFFICIAL).prompt


def test_bad_reasoning_effort_is_a_400():
    from edgeserve.server.errors import APIError

    with pytest.raises(APIError) as e:
        parse_chat_request({"model": "m", "messages": ASK, "reasoning_effort": "extreme"}, 4)
    assert e.value.status == 400 and e.value.param == "reasoning_effort"


# --- grammars ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = write_scripted_gguf(tmp_path_factory.mktemp("h") / "vocab.gguf", [("t", "<|channel|>")], TEMPLATE_SOURCE,
                               specials=SPECIALS)
    return tokenizer_from_gguf(GGUFFile(path).metadata)


def _walk(tok, spec, text):
    """Feed `text` token by token; the index of the first token the grammar masked (None if all passed)."""
    compiler = GrammarCompiler.for_tokenizer(tok, tok.vocab_size)
    state = compiler.start(spec)
    for i, t in enumerate(tok.encode(text, add_special_tokens=False)):
        if not allowed_mask([state], tok.vocab_size)[0, t]:
            return state, i
        assert state.accept([t])
    return state, None


def test_structured_output_constrains_the_final_message_after_free_analysis(tok):
    spec = replace(GrammarSpec.json_schema(CITY), harmony=True)
    free = "<|channel|>analysis<|message|>Any {text}, even <think>.<|end|><|start|>assistant"
    state, masked = _walk(tok, spec, free + '<|channel|>final<|message|>{"city": "Paris"}')
    assert masked is None and state.finished
    allowed = allowed_mask([state], tok.vocab_size)[0].nonzero().flatten().tolist()
    assert set(allowed) <= set(tok.eot_ids) and tok.token_to_id("<|return|>") in allowed
    assert _walk(tok, spec, '<|channel|>final <|constrain|>json<|message|>{"city": "P"}')[1] is None
    # the answer must be the JSON, and the reply must reach a final message to end
    assert _walk(tok, spec, "<|channel|>final<|message|>Paris")[1] is not None
    state, masked = _walk(tok, spec, free)
    assert masked is None and not any(allowed_mask([state], tok.vocab_size)[0, t] for t in tok.eot_ids)


def test_forced_tool_call_grammar(tok):
    other = {"type": "function", "function": {"name": "count", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}
    required = GrammarSpec("lark", tool_call_grammar([WEATHER, other], None, json_rule))
    for reply in ('<|channel|>analysis<|message|>Count.<|end|><|start|>assistant<|channel|>commentary '
                  'to=functions.count <|constrain|>json<|message|>{"n": 3}',
                  '<|channel|>commentary to=functions.get_weather json<|message|>{"city": "Paris"}'):
        state, masked = _walk(tok, required, reply)
        assert masked is None and state.finished, reply
    assert _walk(tok, required, '<|channel|>commentary to=functions.count<|message|>{"city": "x"}')[1] is not None
    assert _walk(tok, required, "<|channel|>final<|message|>")[1] is not None  # a call is required
    named = GrammarSpec("lark", tool_call_grammar([WEATHER, other], "get_weather", json_rule))
    assert _walk(tok, named, "<|channel|>commentary to=functions.count")[1] is not None
    assert _walk(tok, named, '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                             '{"city": "Paris"}')[0].finished


# --- end to end through the four routes ----------------------------------------------------------------------------

HEAD_FINAL = "assistant<|channel|>final<|message|>"  # text pieces (not the special tokens) after <|start|>: a
HEAD_CALL = "assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"  # scripted
ARGS = ('{"city": ', '"Paris"}')  # model repeats no token, and the parser sees the same text either way;
# the arguments in two pieces: llguidance's mask refuses one token spanning a required key's value and the `}`


def _script(*tokens: str) -> list[tuple[str, str]]:
    """Each token followed by the next; "t" is the last token of the prompt (`<|start|>assistant`)."""
    tokens = ("t", *tokens)
    return list(zip(tokens, tokens[1:]))


SCRIPTS = {
    # reasoning, then the answer
    "oss-answer": _script("<|channel|>", "analysis", "<|message|>", THOUGHT, "<|end|>", "<|start|>", HEAD_FINAL,
                          ANSWER, "<|return|>"),
    # reasoning, then a call
    "oss-call": _script("<|channel|>", "analysis", "<|message|>", THOUGHT, "<|end|>", "<|start|>", HEAD_CALL, *ARGS,
                        "<|call|>"),
    # a call, every marker a special token (what a forced-call grammar allows)
    "oss-forced": _script("<|channel|>", "commentary to=functions.get_weather ", "<|constrain|>", "json",
                          "<|message|>", *ARGS, "<|call|>"),
    # a JSON answer, every marker a special token (what a structured-output grammar allows)
    "oss-json": _script("<|channel|>", "final", "<|message|>", *ARGS, "<|return|>"),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("oss")
    paths = [str(write_scripted_gguf(d / f"{name}.gguf", script, TEMPLATE_SOURCE, specials=SPECIALS))
             for name, script in SCRIPTS.items()]
    with serve(ServerConfig(engine=EngineConfig(max_num_seqs=4, kv_cache_gb=0.05), models=tuple(paths),
                            keep_alive=None)) as s:
        yield s


def _post(server, path, body, stream=False):
    return post_api(server, path, body if "input" in body else {"messages": [{"role": "user", "content": "Weather in Paris?"}], **body}, stream)


def _no_markers(obj) -> None:
    text = json.dumps(obj, ensure_ascii=False)
    assert not any(m in text for m in MARKERS), text


def test_openai_chat(server):
    msg = _post(server, "/v1/chat/completions", {"model": "oss-answer"})["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == (THOUGHT, ANSWER)
    chunks = _post(server, "/v1/chat/completions", {"model": "oss-answer"}, stream=True)
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == THOUGHT
    assert "".join(d.get("content") or "" for d in deltas) == ANSWER
    _no_markers(chunks)
    choice = _post(server, "/v1/chat/completions", {"model": "oss-call", "tools": [WEATHER]})["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == THOUGHT
    (call,) = choice["message"]["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("get_weather", PARIS)
    assert not choice["message"]["content"]


def test_openai_chat_constrained(server):
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        choice = _post(server, "/v1/chat/completions", {"model": "oss-forced", "tools": [WEATHER],
                                                         "tool_choice": tool_choice})["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == PARIS
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    msg = _post(server, "/v1/chat/completions", {"model": "oss-json", "response_format": fmt})["choices"][0]["message"]
    assert json.loads(msg["content"]) == PARIS
    # a harmony-framed grammar: the request names no think tags, the prompt ends with the assistant header
    lm = server.manager.entries["oss-json"].lm
    setup = chat_setup(parse_chat_request({"model": "oss-json", "messages": ASK, "response_format": fmt}, 4),
                       lm.chat_template)
    assert setup.constraint.harmony and setup.prompt.endswith("<|start|>assistant")


def test_ollama_chat(server):
    msg = _post(server, "/api/chat", {"model": "oss-answer", "think": "high", "stream": False})["message"]
    assert (msg["thinking"], msg["content"]) == (THOUGHT, ANSWER)
    lines = _post(server, "/api/chat", {"model": "oss-answer"}, stream=True)
    assert "".join(line["message"].get("thinking", "") for line in lines) == THOUGHT
    assert "".join(line["message"]["content"] for line in lines) == ANSWER
    _no_markers(lines)
    msg = _post(server, "/api/chat", {"model": "oss-call", "tools": [WEATHER], "stream": False})["message"]
    assert msg["tool_calls"] == [{"function": {"name": "get_weather", "arguments": PARIS}}]


def test_anthropic_messages(server):
    body = {"model": "oss-answer", "max_tokens": 64, "thinking": {"type": "enabled", "budget_tokens": 2048}}
    reply = _post(server, "/v1/messages", body)
    assert [(b["type"], b.get("thinking") or b.get("text")) for b in reply["content"]] == [
        ("thinking", THOUGHT), ("text", ANSWER)]
    events = _post(server, "/v1/messages", body, stream=True)
    text = "".join(e["delta"].get("text", "") + e["delta"].get("thinking", "") for e in events
                   if e["type"] == "content_block_delta")
    assert text == THOUGHT + ANSWER
    _no_markers(events)
    tools = [{"name": "get_weather", "description": "Weather in a city", "input_schema": CITY}]
    reply = _post(server, "/v1/messages", {"model": "oss-call", "max_tokens": 64, "tools": tools})
    assert reply["stop_reason"] == "tool_use"
    assert [(b["type"], b.get("name"), b.get("input")) for b in reply["content"]] == [
        ("thinking", None, None), ("tool_use", "get_weather", PARIS)]


def test_responses(server):
    body = {"model": "oss-answer", "input": "Weather in Paris?", "reasoning": {"effort": "low"}}
    out = _post(server, "/v1/responses", body)["output"]
    assert [i["type"] for i in out] == ["reasoning", "message"]
    assert out[0]["content"][0]["text"] == THOUGHT and out[1]["content"][0]["text"] == ANSWER
    events = _post(server, "/v1/responses", body, stream=True)
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == ANSWER
    _no_markers(events)
    tools = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": CITY}]
    out = _post(server, "/v1/responses", {"model": "oss-call", "input": "Weather in Paris?", "tools": tools})["output"]
    calls = [i for i in out if i["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", PARIS)]


def test_cli_run_prints_the_answer_and_the_reasoning_apart(tmp_path):
    import subprocess
    import sys

    path = write_scripted_gguf(tmp_path / "oss.gguf", SCRIPTS["oss-answer"], TEMPLATE_SOURCE, specials=SPECIALS)
    proc = subprocess.run([sys.executable, "-m", "edgeserve", "run", str(path), "Weather in Paris?",
                           "--max-tokens", "16"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (proc.stdout, proc.stderr) == (ANSWER + "\n", THOUGHT)


def test_chat_ids_render_harmony(tok):
    from edgeserve.text.chat_prompt import chat_ids

    ids = chat_ids(tok, OFFICIAL, ASK, reasoning_effort="high")
    assert tok.decode(ids) == render_harmony(ASK, None, HarmonyOptions("high"))


def test_end_of_message_never_ends_the_turn(tmp_path):
    """<|return|> and <|call|> end a harmony turn; <|end|> does not, even where the GGUF names it end-of-turn."""
    path = write_scripted_gguf(tmp_path / "v.gguf", [("t", "<|channel|>")], TEMPLATE_SOURCE, specials=SPECIALS)
    metadata = dict(GGUFFile(path).metadata)
    end = tokenizer_from_gguf(metadata).token_to_id("<|end|>")
    for meta in (metadata, {**metadata, "tokenizer.ggml.eot_token_id": end}):
        tokenizer = tokenizer_from_gguf(meta)
        assert {tokenizer.token_to_id(t) for t in ("<|return|>", "<|call|>")} <= tokenizer.eot_ids
        assert end not in tokenizer.eot_ids


def test_ollama_show_lists_thinking_and_tools(server):
    caps = httpx.post(server.url + "/api/show", json={"model": "oss-answer"}, timeout=30).json()["capabilities"]
    assert {"completion", "tools", "thinking"} <= set(caps)
