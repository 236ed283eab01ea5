"""DeepSeek's formats (V3.1, the R1 family, V3.2 / V4 DSML) against llama.cpp's parser expectations and our own
cases (tests/data/chat_formats/deepseek*.json), their detection among llama.cpp's 70 templates, and their forced
grammars."""

from __future__ import annotations

import pytest

from edgeserve.text.formats import get_format
from edgeserve.text.formats.deepseek import TOKENS
from edgeserve.text.formats.deepseek_dsml import DSML
from format_family_check import (accepts, case_id, check_case, context, data_cases, detected_templates, same, tools,
                                 vocab)

CASES = data_cases("deepseek") + data_cases("deepseek_dsml")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_reads_what_llama_cpp_reads(case):
    got, want = check_case(case)
    assert same(got, want), (got, want)


@pytest.mark.parametrize("name, templates", [
    ("deepseek_v3_1", ["deepseek-ai-DeepSeek-V3.1.jinja"]),
    ("deepseek_r1", ["deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
                     "llama-cpp-deepseek-r1.jinja"]),
    ("deepseek_v3_2", ["deepseek-ai-DeepSeek-V3.2.jinja"]),
    ("deepseek_v4", ["deepseek-ai-DeepSeek-V4-Flash-0731.jinja", "deepseek-ai-DeepSeek-V4.jinja"]),
])
def test_detected_for_its_templates_and_no_other(name, templates):
    assert detected_templates(name) == templates


B, E, CB, CE, S = TOKENS[0], TOKENS[1], TOKENS[2], TOKENS[3], TOKENS[4]


def _v31(*calls):
    return B + "".join(f"{CB}{n}{S}{a}{CE}" for n, a in calls) + E


def _r1(*calls):
    return B + "\n".join(f"{CB}function{S}{n}\n```json\n{a}\n```{CE}" for n, a in calls) + E


def _dsml(block, *calls):
    def param(k, v):
        kind = "true" if isinstance(v, str) else "false"
        return f'<{DSML}parameter name="{k}" string="{kind}">{v}</{DSML}parameter>\n'
    body = "".join(f'<{DSML}invoke name="{n}">\n' + "".join(param(k, v) for k, v in a.items()) + f"</{DSML}invoke>\n"
                   for n, a in calls)
    return f"<{DSML}{block}>\n{body}</{DSML}{block}>"


@pytest.fixture(scope="module", params=["markup is special tokens", "markup is text"])
def tok(tmp_path_factory, request):
    specials = (*TOKENS, DSML) if request.param == "markup is special tokens" else ()
    return vocab(tmp_path_factory.mktemp("ds"), specials)


BUILD = {"deepseek_v3_1": _v31, "deepseek_r1": _r1,
         "deepseek_v3_2": lambda *c: _dsml("function_calls", *c), "deepseek_v4": lambda *c: _dsml("tool_calls", *c)}
JSON_ARGS = {"deepseek_v3_1", "deepseek_r1"}


def _reply(name, *calls):
    """A reply of format `name` with `calls` ((function, arguments dict))."""
    import json

    return BUILD[name](*((n, json.dumps(a)) if name in JSON_ARGS else (n, a) for n, a in calls))


@pytest.mark.parametrize("name", list(BUILD))
def test_forced_grammar_admits_calls_that_parse_back_and_refuses_junk(tok, name):
    fmt = get_format(name)
    offered = tools("get_time_tool", "magic_int_tool")
    one = _reply(name, ("get_time", {"city": "Paris"}))
    two = _reply(name, ("magic_int", {"ref": 42, "name": "foo bar"}), ("get_time", {"city": "New York"}))
    spec = fmt.forced(offered, None, True)
    for reply, names in ((one, ["get_time"]), (two, ["magic_int", "get_time"])):
        assert accepts(tok, spec, reply), reply
        content, calls = fmt.parse(reply, context(offered))
        assert content == "" and [c.name for c in calls] == names, reply
    for junk in ("Sure. " + one, _reply(name, ("get_time", {"town": "Paris"})), _reply(name, ("nope", {})),
                 _reply(name, ("magic_int", {"ref": "three"})), _reply(name, ("magic_int", {"name": "no ref"}))):
        assert not accepts(tok, spec, junk), junk
    assert accepts(tok, fmt.forced(offered, None, False), one)
    assert not accepts(tok, fmt.forced(offered, None, False), two)  # parallel calls off: one call
    named = fmt.forced(offered, "magic_int", True)
    assert accepts(tok, named, _reply(name, ("magic_int", {"ref": 7}))) and not accepts(tok, named, one)
