"""Checking one reply format of edgeserve.text.formats against llama.cpp's parser expectations, without a model.

- `reference_tools()`: the tools `tests/test-chat.cpp` declares (`static common_chat_tool NAME{...}`), by variable
  name, as OpenAI tool dicts.
- `read_reply(fmt, text, ...)`: a whole reply split the simple way a server does it: reasoning off by the format's
  tags (an opened thought when the prompt opened it; a close tag alone at the start is an empty thought; a call
  marker inside an open thought ends it for formats with `calls_in_reasoning`), then content up to the first call
  marker, the rest through the format's `parse` (with or without tools: Kimi K3 and muse-glimmer wrap the answer
  itself in markup their parser unwraps). Stop strings of the format cut the reply first.
- `template_source(name)`, `all_templates()`: llama.cpp's chat templates.
- `vocab(tmp, specials)` / `walk(tok, spec, text)`: a byte-level tokenizer with the given special tokens, and a
  forced grammar walked over a text token by token.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from llama_cpp_source import llama_cpp_dir
from format_cases import walk  # noqa: F401 (the families' tests import it from here)

THINK = ("<think>", "</think>")
_COMMENT = r"\s*(?:/\*.*?\*/\s*)?"
_TOOL = re.compile(r"static common_chat_tool (\w+)\{" + _COMMENT + r'"([^"]*)",' + _COMMENT + r'"((?:[^"\\]|\\.)*)",'
                   + _COMMENT + r'(?:R"(\w*)\((.*?)\)\4"|"((?:[^"\\]|\\.)*)")', re.S)


@lru_cache(maxsize=1)
def reference_tools() -> dict[str, dict]:
    """test-chat.cpp's tools by C++ variable name, as OpenAI tool dicts."""
    source = (llama_cpp_dir() / "tests" / "test-chat.cpp").read_text()
    return {var: {"type": "function", "function": {"name": name, "description": json.loads(f'"{about}"'),
                                                   "parameters": json.loads(raw or plain)}}
            for var, name, about, _, raw, plain in _TOOL.findall(source)}


def tools(*names: str) -> list[dict]:
    """The reference tools called `names` (C++ variable names)."""
    return [reference_tools()[n] for n in names]


def template_source(name: str) -> str:
    """The source of llama.cpp's chat template `name` (a file in models/templates)."""
    return (llama_cpp_dir() / "models" / "templates" / name).read_text()


def all_templates() -> list[str]:
    """The file names of llama.cpp's chat templates."""
    return sorted(p.name for p in (llama_cpp_dir() / "models" / "templates").glob("*.jinja"))


@dataclass
class Reply:
    """A reply read back: content, reasoning, calls as (name, arguments object, id)."""

    content: str
    reasoning: str
    calls: list[tuple[str, object, str]] = field(default_factory=list)


def context(tool_list: list[dict]) -> CallContext:
    """The CallContext of a request offering `tool_list`."""
    return CallContext({t["function"]["name"] for t in tool_list},
                       {t["function"]["name"]: t["function"].get("parameters") or {} for t in tool_list})


def split_reasoning(fmt: ChatFormat, text: str, opened: bool) -> tuple[str, str]:
    """(reasoning, rest) of a reply by the format's tags (see the module docstring)."""
    open_, close = fmt.reasoning or THINK
    body = text.lstrip()
    if not opened:
        if body.startswith(close):
            return "", body[len(close):]
        if not body.startswith(open_):
            return "", text
        body = body[len(open_):]
    end = body.find(close)
    if fmt.calls_in_reasoning:
        marks = [i for m in fmt.call_markers if (i := body.find(m)) >= 0 and (end < 0 or i < end)]
        if marks:
            return body[:min(marks)], body[min(marks):]
    if end < 0:
        return body, ""
    return body[:end], body[end + len(close):]


def read_reply(fmt: ChatFormat, text: str, tool_list: list[dict] = (), opened: bool = False) -> Reply:
    """A whole reply of format `fmt` read back (see the module docstring)."""
    for stop in fmt.stop:
        text = text.split(stop, 1)[0]
    reasoning, rest = split_reasoning(fmt, text, opened)
    calls: list[ToolCall] = []
    starts = [i for m in fmt.call_markers if (i := rest.find(m)) >= 0]
    if fmt.parse is not None and starts:  # also without tools: some formats' markers wrap the answer itself
        at = min(starts)
        left, calls = fmt.parse(rest[at:], context(list(tool_list)))
        rest = rest[:at] + left
    return Reply(rest.strip(), reasoning.strip(), [(c.name, json.loads(c.arguments), c.id) for c in calls])


def expect(content: str = "", reasoning: str = "", calls: list[tuple] = ()) -> Reply:
    """An expected reply: calls as (name, arguments JSON text[, id])."""
    return Reply(content.strip(), reasoning.strip(),
                 [(c[0], json.loads(c[1]), c[2] if len(c) > 2 else "") for c in calls])


def same(got: Reply, want: Reply) -> bool:
    """Equal content, reasoning and calls; a call id is compared only where the expectation names one."""
    ids = [g[2] if w[2] else "" for g, w in zip(got.calls, want.calls)]
    return (got.content, got.reasoning, [(n, a) for n, a, _ in got.calls], ids) == (
        want.content, want.reasoning, [(n, a) for n, a, _ in want.calls], [w[2] for w in want.calls])


def detected_templates(name: str) -> list[str]:
    """The llama.cpp templates whose detected format (the first registered one whose `detect` accepts the
    template) is `name`."""
    from edgeserve.text.formats import all_formats

    def first(source: str) -> str | None:
        return next((f.name for f in all_formats() if f.detect(source)), None)

    return [t for t in all_templates() if first(template_source(t)) == name]


# --- forced grammars ------------------------------------------------------------------------------------------


def vocab(folder: Path, specials: tuple[str, ...] = ()):
    """A byte-level tokenizer whose special tokens include `specials` (each one token, as in the real vocabulary)."""
    from edgeserve.loaders.gguf_file import GGUFFile
    from edgeserve.loaders.tokenizer import tokenizer_from_gguf
    from scripted_gguf import write_scripted_gguf

    path = write_scripted_gguf(folder / "vocab.gguf", [("t", "x")], "{{ messages }}", specials=specials)
    return tokenizer_from_gguf(GGUFFile(path).metadata)



def accepts(tok, spec, text: str) -> bool:
    """Whether the grammar allows all of `text` and may end right after it."""
    from edgeserve.text.grammar import allowed_mask

    state, masked = walk(tok, spec, text)
    return masked is None and bool(any(allowed_mask([state], tok.vocab_size)[0, t] for t in tok.eot_ids))


# --- the data files (tests/data/chat_formats/<family>.json) ------------------------------------------------------

DATA = Path(__file__).parent / "data" / "chat_formats"
# templates our renderer cannot render yet (their generation prompt opens the thought, as llama.cpp renders it)
OPENS_THOUGHT = {"llama-cpp-deepseek-r1.jinja": True}


def data_cases(family: str) -> list[dict]:
    """The cases of tests/data/chat_formats/<family>.json."""
    return json.loads((DATA / f"{family}.json").read_text())


def case_id(case: dict) -> str:
    """A short test id: the template and the line of test-chat.cpp (0: our own case)."""
    return f"{case['template'].removesuffix('.jinja')}:{case['line']}"


def prompt_opens_thought(case: dict, fmt: ChatFormat) -> bool:
    """Whether the case's prompt (a user message, its tools, its reasoning switch) ends inside an open thought."""
    from edgeserve.loaders.chat_template import ChatTemplate

    if case["template"] in OPENS_THOUGHT:
        return OPENS_THOUGHT[case["template"]]
    extra = {s: case["enable_thinking"] for s in fmt.thinking_switches} if case["enable_thinking"] is not None else {}
    if case["tools"]:
        extra["tools"] = case["tools"]
    prompt = ChatTemplate(template_source(case["template"]), bos_token="<s>", eos_token="</s>").render(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True, **extra)
    return prompt.rstrip().endswith((fmt.reasoning or THINK)[0].strip())


def check_case(case: dict) -> tuple[Reply, Reply]:
    """(what the detected format reads out of the case's input, what llama.cpp expects)."""
    from edgeserve.text.formats import detect_format

    fmt = detect_format(template_source(case["template"]))
    got = read_reply(fmt, case["input"], case["tools"], prompt_opens_thought(case, fmt))
    want = case["expect"]
    return got, expect(want["content"], want["reasoning_content"],
                       [(c["name"], c["arguments"], c["id"]) for c in want["tool_calls"]])


def family_tests(family: str, templates: dict[str, list[str]]):
    """The two tests every format family's module runs, to bind to `test_...` names there: the cases of
    tests/data/chat_formats/<family>.json read as llama.cpp reads them, and each format of `templates` detected for
    exactly its templates among llama.cpp's."""
    import pytest

    @pytest.mark.parametrize("case", data_cases(family), ids=case_id)
    def reads_what_llama_cpp_reads(case):
        got, want = check_case(case)
        assert same(got, want), (got, want)

    @pytest.mark.parametrize("name, templates", list(templates.items()))
    def detected_for_its_templates_and_no_other(name, templates):
        assert detected_templates(name) == templates
    return reads_what_llama_cpp_reads, detected_for_its_templates_and_no_other


def check_forced_calls(tok, fmt: ChatFormat, offered: list[dict], replies: list[tuple[str, list[dict]]],
                       junk: list[str], named_reply: str, parsed=lambda reply: reply):
    """The format's forced grammar with a call required over `offered`: it admits each (reply, arguments) of
    `replies`, whose parse (of `parsed(reply)`) is no content and calls with exactly those arguments, and refuses
    every text of `junk`; with parallel calls off it refuses the last reply (several calls); required to call
    `magic_int` it admits `named_reply` and refuses the first reply. Returns the grammar, for more checks."""
    spec = fmt.forced(offered, None, True)
    for reply, args in replies:
        assert accepts(tok, spec, reply), reply
        content, calls = fmt.parse(parsed(reply), context(offered))
        assert content == "" and [json.loads(c.arguments) for c in calls] == args, reply
    for text in junk:
        assert not accepts(tok, spec, text), text
    assert not accepts(tok, fmt.forced(offered, None, False), replies[-1][0])
    named = fmt.forced(offered, "magic_int", True)
    assert accepts(tok, named, named_reply) and not accepts(tok, named, replies[0][0])
    return spec
