"""The reply-format registry (edgeserve.text.formats) and what it drives in chat_setup: detection on llama.cpp's
real templates, Qwen3.5 calls inside an open thought, Gemma 4's stop at `<|tool_response>` and its stray channel
markers, reasoning kept raw (reasoning_format "none"), the reasoning switch under every name templates read,
thoughts of templates that always open one, named `tool_use` templates, Gemma 2's missing system role,
`--tool-format`, and malformed calls coming back as content. Expectations follow llama.cpp's tests/test-chat.cpp.
The end-to-end checks run tiny scripted models (scripted_gguf.py) through a test-started server."""

from __future__ import annotations

import json

import httpx
import pytest

from edgeserve.engine.outputs import RequestOutput
from edgeserve.loaders.chat_template import ChatTemplate, chat_template_from_gguf, chat_template_from_hf_folder
from edgeserve.server.chat_setup import ChatSetup, chat_setup, format_stops
from edgeserve.server.request import GenerationRequest
from edgeserve.text.chat_output import ToolSetup
from edgeserve.text.formats import MODULES, ChatFormat, all_formats, detect_format, get_format
from llama_cpp_source import llama_cpp_dir


def _template(name: str) -> ChatTemplate:
    return ChatTemplate((llama_cpp_dir() / "models" / "templates" / f"{name}.jinja").read_text(), "<s>", "</s>")


def _tool(name: str, properties: dict | None = None) -> dict:
    props = properties if properties is not None else {"city": {"type": "string"}}
    return {"type": "function", "function": {"name": name, "description": f"{name} of a place",
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": list(props)}}}


WEATHER = _tool("get_weather")
RUN = _tool("run_in_terminal", {"command": {"type": "string"}})
ASK = [{"role": "user", "content": "Hi"}]


def _setup(template: ChatTemplate, **fields) -> ChatSetup:
    tools = fields.get("tools")
    fields.setdefault("tool_choice", "auto" if tools else "none")
    return chat_setup(GenerationRequest(model="m", messages=fields.pop("messages", ASK), **fields), template)


def _read(setup: ChatSetup, pieces: list[str], finish: str = "stop"):
    """(reasoning, content, [(name, arguments)], finish_reason) of a reply fed in `pieces`, as the server does."""
    parser = setup.parser()
    reasoning = content = ""
    calls = []
    for i, piece in enumerate(pieces):
        out = RequestOutput(request_id="r", text=piece, token_ids=[], logprobs=None,
                            finish_reason=finish if i == len(pieces) - 1 else None)
        setup.split(parser, out)
        reasoning, content, calls = reasoning + out.reasoning, content + out.text, calls + (out.tool_calls or [])
    return reasoning, content, [(c.name, json.loads(c.arguments)) for c in calls], out.finish_reason


def _whole_and_streamed(setup: ChatSetup, text: str):
    """The reply read whole; asserts that read one character at a time it is the same."""
    whole = _read(setup, [text])
    assert _read(setup, list(text)) == whole
    return whole


# --- the registry -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("template, name", [
    ("Qwen3.5-4B", "qwen3_coder"), ("Qwen3-Coder", "qwen3_coder"), ("google-gemma-4-31B-it", "gemma4"),
    ("mistralai-Mistral-Nemo-Instruct-2407", "mistral"), ("meta-llama-Llama-3.1-8B-Instruct", "llama3"),
    ("meta-llama-Llama-3.3-70B-Instruct", "llama3"), ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "hermes"),
    ("Qwen-Qwen2.5-7B-Instruct", "hermes"), ("google-gemma-2-2b-it", "hermes"),  # no calls of its own: ours
])
def test_detect_format_on_real_templates(template, name):
    assert detect_format(_template(template).source).name == name


def test_registry_lists_its_modules_and_names_the_known_ones():
    assert {"hermes", "mistral", "llama3", "gemma4", "qwen3_coder"} <= {f.name for f in all_formats()}
    assert {"hermes", "mistral", "llama3", "gemma4", "qwen3_coder"} <= set(MODULES)
    with pytest.raises(ValueError, match="unknown tool format 'nope'; known: .*hermes"):
        get_format("nope")


# --- Qwen3.5: a call ends the open thought ------------------------------------------------------------------------

CALL = ("<tool_call>\n<function=run_in_terminal>\n<parameter=command>\npwd\n</parameter>\n</function>\n"
        "</tool_call>")
PWD = [("run_in_terminal", {"command": "pwd"})]


@pytest.mark.parametrize("text, reasoning, content", [
    ("Need to inspect the current directory.\n" + CALL, "Need to inspect the current directory.", ""),
    (CALL, "", ""),  # no thought at all: the call ends the opened one at once
    ("I should inspect the directory.\n</think>\n\nLet me inspect it now.\n" + CALL,
     "I should inspect the directory.", "Let me inspect it now.\n"),
])
def test_qwen35_call_inside_the_open_thought_is_a_call(text, reasoning, content):
    setup = _setup(_template("Qwen3.5-4B"), tools=[RUN], think=True)
    assert setup.in_thought and setup.fmt.calls_in_reasoning
    assert _whole_and_streamed(setup, text) == (reasoning, content, PWD, "tool_calls")


def test_a_call_marker_in_a_thought_is_reasoning_without_tools():
    setup = _setup(_template("Qwen3.5-4B"), think=True)
    assert _read(setup, ["About <tool_call> tags.\n</think>\n\nDone."])[:2] == ("About <tool_call> tags.", "Done.")


def test_a_call_id_the_model_writes_is_kept():
    setup = _setup(_template("mistralai-Mistral-Nemo-Instruct-2407"), tools=[WEATHER])
    out = RequestOutput(request_id="r", token_ids=[], logprobs=None, finish_reason="stop",
                        text='[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "123456789"}]')
    setup.split(setup.parser(), out)
    assert [(c.name, c.id) for c in out.tool_calls] == [("get_weather", "123456789")]


def test_qwen3_coder_union_with_string_reads_objects():
    union = _tool("set_union", {"value": {"type": ["string", "object"]}, "amount": {"type": ["string", "integer"]}})
    setup = _setup(_template("Qwen3-Coder"), tools=[union])
    text = ("<tool_call>\n<function=set_union>\n<parameter=value>\n{\"a\": 1}\n</parameter>\n"
            "<parameter=amount>\n2 dollars\n</parameter>\n</function>\n</tool_call>")
    assert _read(setup, [text])[2] == [("set_union", {"value": {"a": 1}, "amount": "2 dollars"})]


# --- Gemma 4 ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, reasoning", [
    ("<|channel>thought\nI'm\nthinking<channel|>Hello, world!\nWhat's up?", "I'm\nthinking"),
    ("<|channel>thought<channel|>Hello, world!\nWhat's up?", ""),  # an empty thought without its newline
    ("<|channel>thought\n<channel|>Hello, world!\nWhat's up?<channel|>", ""),  # a stray close
    ("<|channel>thought\n<channel|>Hello, world!\nWhat's up?<|channel>thought\n<channel|>", ""),
    ("<|channel>thought\n<channel|>Hello, world!\nWhat's up?<|channel>thought\n<channel|><channel|>", ""),
    ("<|channel><|channel>thought\n<channel|>Hello, world!\nWhat's up?", ""),
])
def test_gemma4_thoughts_and_stray_markers(text, reasoning):
    setup = _setup(_template("google-gemma-4-31B-it"), think=True)
    assert _whole_and_streamed(setup, text) == (reasoning, "Hello, world!\nWhat's up?", [], "stop")


def test_gemma4_stops_at_tool_response():
    setup = _setup(_template("google-gemma-4-31B-it"), tools=[WEATHER])
    assert setup.stop == ("<|tool_response>",)
    vocab = {"<|tool_response>": 7}
    as_token = format_stops({"stop": ["x"]}, setup.stop, vocab.get)
    assert as_token["stop_token_ids"] == [7] and as_token["stop"] == ["x"]
    as_text = format_stops({"stop": "x"}, setup.stop, {}.get)  # no such token: a stop string
    assert as_text["stop"] == ["x", "<|tool_response>"] and as_text["stop_token_ids"] == []
    full = format_stops({"stop": [str(i) for i in range(16)]}, setup.stop, {}.get)
    assert len(full["stop"]) == 16  # never past the request's limit
    from edgeserve.loaders.gguf_file import GGUFFile
    from edgeserve.loaders.tokenizer import tokenizer_from_gguf

    gemma = tokenizer_from_gguf(GGUFFile(llama_cpp_dir() / "models" / "ggml-vocab-gemma-4.gguf").metadata)
    token = gemma.token_to_id("<|tool_response>")  # Gemma 4's own vocabulary has it as one token
    assert token is not None and format_stops({}, setup.stop, gemma.token_to_id)["stop_token_ids"] == [token]


def test_a_forced_reply_in_the_format_own_syntax_is_read():
    setup = _setup(_template("google-gemma-4-31B-it"), tools=[WEATHER], tool_choice="required")
    # Gemma 4's forced calls are its own syntax (edgeserve.text.formats.gemma4_grammar), not a JSON wrapper
    assert setup.constraint.kind == "lark" and '"call:get_weather"' in setup.constraint.source
    native = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
    assert _read(setup, [native])[1:] == ("", [("get_weather", {"city": "Paris"})], "tool_calls")


def test_gemma4_call_after_reasoning():
    setup = _setup(_template("google-gemma-4-31B-it"), tools=[WEATHER], think=True)
    text = "<|channel>thought\nI'm\nthinking<channel|><|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>}<tool_call|>"
    assert _whole_and_streamed(setup, text) == ("I'm\nthinking", "", [("get_weather", {"city": "Paris"})],
                                                "tool_calls")


# --- reasoning_format "none", reasoning off, the switch's names ------------------------------------------------------

def test_reasoning_format_none_keeps_the_thought_in_the_content():
    setup = _setup(_template("Qwen3.5-4B"), think=True, reasoning_format="none")
    text = "I'm\nthinking\n</think>\n\nHello, world!\nWhat's up?"
    assert _whole_and_streamed(setup, text) == ("", "<think>\n" + text, [], "stop")
    gemma = _setup(_template("google-gemma-4-31B-it"), think=True, reasoning_format="none")
    raw = "<|channel>thought\nI'm\nthinking<channel|>Hello, world!\nWhat's up?"
    assert _whole_and_streamed(gemma, raw) == ("", raw, [], "stop")


def test_reasoning_format_is_a_chat_field():
    from edgeserve.server.api.openai import parse_chat_request
    from edgeserve.server.errors import APIError

    body = {"model": "m", "messages": ASK}
    assert parse_chat_request({**body, "reasoning_format": "none"}, 1).reasoning_format == "none"
    assert parse_chat_request(body, 1).reasoning_format is None
    with pytest.raises(APIError) as e:
        parse_chat_request({**body, "reasoning_format": "raw"}, 1)
    assert e.value.status == 400 and "reasoning_format" in str(e.value)


@pytest.mark.parametrize("template", ["deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "StepFun3.5-Flash", "MiniMax-M2",
                                      "NVIDIA-Nemotron-Nano-v2"])
def test_reasoning_off_on_a_template_that_always_opens_a_thought(template):
    setup = _setup(_template(template), think=False)
    assert setup.in_thought
    assert _whole_and_streamed(setup, "I think.\n</think>\n\nAnswer.") == ("I think.", "Answer.", [], "stop")


def test_reasoning_off_still_takes_a_thought_the_model_writes():
    setup = _setup(_template("LFM2.5-8B-A1B"), think=False)
    assert _read(setup, ["<think>I think.</think>\nAnswer."])[:2] == ("I think.", "Answer.")


@pytest.mark.parametrize("template", ["MiniMax-M3", "ByteDance-Seed-OSS", "Cohere2MoE", "Kimi-K3",
                                      "ibm-granite-granite-3.3-2B-Instruct"])
def test_reasoning_switch_reaches_templates_keyed_on_other_names(template):
    t = _template(template)
    assert t.render(ASK, enable_thinking=True) == t.render(ASK, enable_thinking=False)  # not keyed on this name
    assert _setup(t, think=True).prompt != _setup(t, think=False).prompt


def test_explicit_template_kwargs_win_over_the_switch():
    t = _template("ByteDance-Seed-OSS")
    budget = _setup(t, think=False, template_kwargs={"thinking_budget": 512}).prompt
    assert "512" in budget and "thinking budget is 0" not in budget


# --- prompts: named tool_use templates, templates without a system role ---------------------------------------------

def test_gguf_tool_use_template_renders_requests_with_tools():
    tool_use = _template("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use").source
    meta = {"tokenizer.chat_template": "PLAIN{% for m in messages %}{{ m.content }}{% endfor %}",
            "tokenizer.chat_template.tool_use": tool_use, "tokenizer.ggml.tokens": ["x"]}
    template = chat_template_from_gguf(meta)
    assert template.tool_use is not None and template.tool_use.source == tool_use
    with_tools = _setup(template, tools=[WEATHER])
    assert "<tools>" in with_tools.prompt and "get_weather" in with_tools.prompt and "PLAIN" not in with_tools.prompt
    assert _setup(template).prompt == "PLAINHi"
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert _read(with_tools, [call])[2] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("layout", ["named list", "additional file"])
def test_hf_folder_tool_use_template(tmp_path, layout):
    if layout == "named list":
        named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T{{ tools | length }}"}]
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    else:
        (tmp_path / "tokenizer_config.json").write_text("{}")
        (tmp_path / "chat_template.jinja").write_text("D")
        (tmp_path / "additional_chat_templates").mkdir()
        (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("T{{ tools | length }}")
    template = chat_template_from_hf_folder(tmp_path)
    assert template.render([]) == "D"
    assert _setup(template, tools=[WEATHER]).prompt == "T1"
    assert _setup(template).prompt == "D"


def test_gemma2_takes_the_tools_prompt_in_the_first_user_message():
    template = _template("google-gemma-2-2b-it")
    assert not template.accepts_system()
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris and Rome?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": i, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}}
                   for i, c in (("a", "Paris"), ("b", "Rome"))]},
               {"role": "tool", "tool_call_id": "a", "content": "18 C"},
               {"role": "tool", "tool_call_id": "b", "content": "21 C"}]
    prompt = _setup(template, tools=[WEATHER], messages=history).prompt
    user = prompt.split("<start_of_turn>user\n", 1)[1]
    assert user.startswith("Be brief.\n\n# Tools") and "get_weather" in user.split("<end_of_turn>")[0]
    assert "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n21 C\n</tool_response>" in prompt
    assert prompt.endswith("<start_of_turn>model\n")


# --- --tool-format ----------------------------------------------------------------------------------------------------

def test_tool_format_overrides_detection():
    from edgeserve.errors import ConfigError
    from edgeserve.server import ServerConfig

    template = _template("Qwen-Qwen2.5-7B-Instruct")
    req = GenerationRequest(model="m", messages=ASK, tools=[WEATHER], tool_choice="auto")
    setup = chat_setup(req, template, tool_format="gemma4")
    assert setup.tools.format.name == "gemma4"
    assert _read(setup, ['<|tool_call>call:get_weather{city:<|"|>Rome<|"|>}<tool_call|>'])[2] == [
        ("get_weather", {"city": "Rome"})]
    with pytest.raises(ConfigError, match="tool_format must be one of .*qwen3_coder.*--tool-format"):
        ServerConfig(tool_format="nope")


def test_tool_format_flag_is_a_one_line_error(capsys):
    from edgeserve.cli import main

    assert main(["serve", "--tool-format", "nope"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tool-format" in err[0] and "hermes" in err[0]


# --- malformed calls: content, finish_reason "stop", nothing lost ----------------------------------------------------

MALFORMED = {
    "Qwen-Qwen2.5-7B-Instruct": [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # unclosed
        '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>',  # not JSON
        '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',  # arguments no object
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',  # not offered
    ],
    "mistralai-Mistral-Nemo-Instruct-2407": [
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {city: Paris}}]',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
    ],
    "meta-llama-Llama-3.1-8B-Instruct": [
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Par',
        '{"name": "get_weather", "parameters": {city: Paris}}',
        '{"name": "get_time", "parameters": {}}',
    ],
    "google-gemma-4-31B-it": [
        '<|tool_call>call:get_weather{city:<|"|>Par',
        '<|tool_call>call:get_weather{city:<|"|>Paris}<tool_call|>',
        '<|tool_call>call:get_time{}<tool_call|>',
    ],
    "Qwen3-Coder": [
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
    ],
}
VALID = {
    "Qwen-Qwen2.5-7B-Instruct": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "mistralai-Mistral-Nemo-Instruct-2407": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "meta-llama-Llama-3.1-8B-Instruct": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "google-gemma-4-31B-it": '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
    "Qwen3-Coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                   "</tool_call>",
}


@pytest.mark.parametrize("template", sorted(MALFORMED))
def test_malformed_calls_come_back_as_content(template):
    setup = _setup(_template(template), tools=[WEATHER])
    assert _whole_and_streamed(setup, "Sure. " + VALID[template])[2:] == ([("get_weather", {"city": "Paris"})],
                                                                         "tool_calls")
    for text in MALFORMED[template]:
        assert _whole_and_streamed(setup, "Sure. " + text) == ("", "Sure. " + text, [], "stop"), text


@pytest.mark.parametrize("fmt", [f for f in all_formats() if f.parse is not None], ids=lambda f: f.name)
def test_every_format_keeps_text_that_is_no_call(fmt):
    """The registry's contract, for every module: a reply with no valid call comes back whole as content."""
    from edgeserve.text.formats import CallContext

    ctx = CallContext({"f"}, {"f": {"type": "object", "properties": {"x": {"type": "integer"}}}})
    for marker in fmt.call_markers:
        for tail in ("", "{", '{"name": "g", "arguments": {}}', "g>\n", "f[", " junk ", "\u00e9\n</x>"):
            text = "Before " + marker + tail
            content, calls = fmt.parse(text[text.index(marker):], ctx)
            # an answer wrapper (`<response>`, `<|START_TEXT|>`) is markup a format may drop; the text never
            assert calls or content == text[text.index(marker):] or (marker not in content and tail.strip() in content), \
                (marker, tail, content)


def test_a_parser_that_fails_leaves_the_reply_as_content():
    def broken(text, ctx):
        raise RuntimeError("bug")

    fmt = ChatFormat("broken", detect=lambda s: False, call_markers=("<<",), parse=broken)
    setup = ChatSetup("", None, False, False, ToolSetup("auto", fmt, {"f"}))
    assert _read(setup, ["Hi <<f>>"]) == ("", "Hi <<f>>", [], "stop")


# --- through the server: the stop reaches the engine, a malformed call is a 200 ---------------------------------------

GEMMAISH = ("{% for t in tools or [] %}<|tool>{{ t.function.name }}<tool|>{% endfor %}"
            "{% for m in messages %}<|turn>{{ m.role }}\n{{ m.content }}<turn|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|turn>model\n{% endif %}{# <|tool_call> #}")
GEMMA_CALL = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
INVENTED = "response:get_weather{temperature:18}"
BROKEN = '{"name": "get_weather", "arguments": {"city": "Paris"</tool_call>'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from edgeserve.engine.config import EngineConfig
    from edgeserve.server import ServerConfig
    from scripted_gguf import NEWLINE, TOOL_TEMPLATE, write_scripted_gguf
    from server_helpers import serve

    d = tmp_path_factory.mktemp("formats")
    gemma = write_scripted_gguf(d / "gemmaish.gguf", [(NEWLINE, GEMMA_CALL), (GEMMA_CALL, "<|tool_response>"),
                                                      ("<|tool_response>", INVENTED), (INVENTED, "<|im_end|>")],
                                GEMMAISH)
    broken = write_scripted_gguf(d / "broken.gguf", [(NEWLINE, "<tool_call>"), ("<tool_call>", BROKEN),
                                                     (BROKEN, "<|im_end|>")], TOOL_TEMPLATE)
    with serve(ServerConfig(engine=EngineConfig(max_num_seqs=2, kv_cache_gb=0.05), models=(str(gemma), str(broken)),
                            keep_alive=None, max_loaded_models=2)) as s:
        yield s


def _chat(server, model: str, stream: bool = False):
    body = {"model": model, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
            "temperature": 0, "max_tokens": 12, "stream": stream}
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    content = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    finish = [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"] and ch["choices"][0]["finish_reason"]]
    return content, finish


def test_gemma4_reply_ends_at_the_tool_response_token(server):
    choice = _chat(server, "gemmaish")
    assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
    (call,) = choice["message"]["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("get_weather", {"city": "Paris"})


def test_malformed_call_is_content_with_finish_stop(server):
    choice = _chat(server, "broken")
    assert choice["finish_reason"] == "stop" and not choice["message"].get("tool_calls")
    assert choice["message"]["content"] == "<tool_call>" + BROKEN
    assert _chat(server, "broken", stream=True) == ("<tool_call>" + BROKEN, ["stop"])
