"""Helpers for the per-family format tests (tests/text/test_formats_*.py): llama.cpp's test tools, a reply split the
simple way (reasoning by the format's tags, content up to the first call marker, the rest through its parser),
template detection over llama.cpp's 70 templates, and walking a forced grammar over a small vocabulary in which
the format's markup are single special tokens."""

from __future__ import annotations

import json
import random
from pathlib import Path

from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.loaders.tokenizer import tokenizer_from_gguf
from edgeserve.text.formats import CallContext, ChatFormat, detect_format
from edgeserve.text.grammar import GrammarCompiler, GrammarSpec, allowed_mask
from llama_cpp_source import llama_cpp_dir
from scripted_gguf import write_scripted_gguf


def tool(name: str, properties: dict, required: list[str] | None = None) -> dict:
    """An OpenAI tool dict."""
    properties = {k: {"description": k, **v} for k, v in properties.items()}  # Command R+'s template needs one
    params = {"type": "object", "properties": properties}
    if required is not None:
        params["required"] = required
    return {"type": "function", "function": {"name": name, "description": name, "parameters": params}}


# the tools of llama.cpp's tests/test-chat.cpp
SPECIAL = tool("special_function", {"arg1": {"type": "integer"}}, ["arg1"])
SPECIAL_OPT = tool("special_function_with_opt", {"arg1": {"type": "integer"}, "arg2": {"type": "integer"}}, ["arg1"])
PYTHON = tool("python", {"code": {"type": "string"}}, ["code"])
HTML = tool("html", {"markup": {"type": "string"}}, ["markup"])
GET_TIME = tool("get_time", {"city": {"type": "string"}}, ["city"])
TODO_LIST = tool("todo_list", {"todos": {"type": "array"}}, ["todos"])
EMPTY_ARGS = tool("empty_args", {})
# a tool whose every value is finite (a random walk through its grammar ends)
PICK = tool("pick", {"color": {"enum": ["red", "green"]}, "on": {"type": "boolean"}}, ["color", "on"])
PICK["function"]["parameters"]["additionalProperties"] = False

CALL = ("special_function", {"arg1": 1})
HELLO = "Hello, world!\nWhat's up?"


def context(tools: list[dict]) -> CallContext:
    """The parser context of a request with `tools`."""
    return CallContext({t["function"]["name"] for t in tools},
                       {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools})


def split(fmt: ChatFormat, text: str, tools: list[dict], opened: bool = False,
          reasoning: tuple[str, str] | None = None) -> tuple[str, str, list[tuple[str, dict, str]]]:
    """(content, reasoning, [(name, arguments, id)]) of a whole reply: the thought between the format's tags (from
    the start when the prompt `opened` it), then content up to the first call marker and the rest parsed."""
    tags = reasoning or fmt.reasoning
    thought = ""
    if tags is not None:
        body = text.lstrip()
        if opened or (tags[0] and body.startswith(tags[0])):
            body = body if opened else body[len(tags[0]):]
            end = body.find(tags[1])
            thought, text = (body, "") if end < 0 else (body[:end], body[end + len(tags[1]):].lstrip())
    calls = []
    if fmt.parse is not None:  # with no tools too: some formats wrap their answer in markup the parser drops
        starts = [at for m in fmt.call_markers if (at := text.find(m)) >= 0]
        if starts:
            at = min(starts)
            rest, found = fmt.parse(text[at:], context(tools))
            text = text[:at] + rest
            calls = [(c.name, json.loads(c.arguments), c.id) for c in found]
    return text, thought, calls


def templates() -> dict[str, str]:
    """llama.cpp's chat templates: file name -> source."""
    folder = llama_cpp_dir() / "models" / "templates"
    return {p.name: p.read_text() for p in sorted(folder.glob("*.jinja"))}


def detections() -> dict[str, str]:
    """llama.cpp's chat templates: file name -> the name of the format detected for it."""
    return {name: _detect(src) for name, src in templates().items()}


def assert_detected_exactly(expected: dict[str, str]) -> None:
    """Over llama.cpp's templates, each template of `expected` is detected as its format, and no other template as
    any of those formats."""
    names = set(expected.values())
    assert {t: f for t, f in detections().items() if f in names} == expected


def _detect(source: str) -> str:
    try:
        return detect_format(source).name
    except ValueError:  # the fallback format is not registered (a branch without it)
        return "hermes"


def vocabulary(tmp: Path, specials: tuple[str, ...]):
    """A small byte-level tokenizer where each of `specials` is one special token."""
    path = write_scripted_gguf(tmp / "vocab.gguf", [("t", "x")], "{{ messages }}", specials=specials)
    return tokenizer_from_gguf(GGUFFile(path).metadata)


def walk(tok, spec: GrammarSpec, text: str):
    """Feed `text` token by token: (state, index of the first token the grammar masked, or None)."""
    state = GrammarCompiler.for_tokenizer(tok, tok.vocab_size).start(spec)
    for i, t in enumerate(tok.encode(text, add_special_tokens=False)):
        if not allowed_mask([state], tok.vocab_size)[0, t]:
            return state, i
        assert state.accept([t])
    return state, None


def accepts(tok, spec: GrammarSpec, text: str) -> bool:
    """Whether the grammar admits `text` as a whole reply (every token allowed, end-of-turn allowed after)."""
    state, masked = walk(tok, spec, text)
    return masked is None and any(allowed_mask([state], tok.vocab_size)[0, t] for t in tok.eot_ids)


def random_reply(tok, spec: GrammarSpec, seed: int, steps: int = 3000, prefix: str = "") -> str:
    """A reply a random-weight model would write under the grammar: uniformly random allowed tokens (end of turn
    as soon as it is allowed) until the grammar ends. `prefix`: text the reply starts with (a thought), which the
    grammar must allow."""
    rng = random.Random(seed)
    state = GrammarCompiler.for_tokenizer(tok, tok.vocab_size).start(spec)
    eot = set(tok.eot_ids)
    ids: list[int] = tok.encode(prefix, add_special_tokens=False) if prefix else []
    for t in ids:
        assert allowed_mask([state], tok.vocab_size)[0, t] and state.accept([t]), prefix
    for _ in range(steps):
        allowed = allowed_mask([state], tok.vocab_size)[0].nonzero().flatten().tolist()
        if any(t in eot for t in allowed):
            break
        t = rng.choice(allowed)
        assert state.accept([t])
        ids.append(t)
    else:
        raise AssertionError("the grammar did not end")
    return tok.decode(ids, skip_special_tokens=False)



def forced_calls_parse_back(tok, grammar, name: str, seed: int, offered: list[dict] | None = None) -> list:
    """A random reply that `grammar([PICK], None, True)` (a call required) admits parses with format `name` (its tools
    `offered`, default [PICK]) to no content and at least one call; the calls."""
    from edgeserve.text.formats import get_format

    reply = random_reply(tok, grammar([PICK], None, True), seed)
    content, calls = get_format(name).parse(reply, context(offered or [PICK]))
    assert content == "" and calls, reply
    return calls

def check(name: str, text: str, tools: list[dict], opened: bool, expect: tuple) -> list[tuple[str, dict, str]]:
    """Assert that format `name` splits `text` into `expect` = (content, reasoning, [(name, args[, id])]); the ids
    are compared where `expect` gives one. Returns the calls read."""
    from edgeserve.text.formats import get_format

    content, reasoning, calls = split(get_format(name), text, tools, opened)
    assert (content, reasoning) == expect[:2]
    assert [c[:2] for c in calls] == [tuple(c[:2]) for c in expect[2]]
    for got, want in zip(calls, expect[2]):
        if len(want) == 3:
            assert got[2] == want[2]
    return calls


def no_call_stays_text(fmt: str, texts: list[str], tools: list[dict] | None = None):
    """A test (to bind to `test_what_is_no_call_stays_text`) that each of `texts` is read by format `fmt` as plain
    content and no call, with `tools` (default: SPECIAL) offered."""
    import pytest

    from edgeserve.text.formats import get_format

    @pytest.mark.parametrize("text", texts)
    def what_is_no_call_stays_text(text):
        assert get_format(fmt).parse(text, context(tools or [SPECIAL])) == (text, [])
    return what_is_no_call_stays_text
