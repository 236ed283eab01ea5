"""This batch's formats on broken and hostile replies: every cut of every data case's reply parses without an
error, and a reply read as no call comes back as content exactly; long unclosed markup parses in linear time."""

from __future__ import annotations

import time

import pytest

from edgeserve.text.formats import get_format
from format_family_check import context, data_cases

FAMILIES = ("deepseek", "deepseek_dsml", "glm", "kimi", "minimax", "seed_oss", "nemotron", "muse_glimmer")
FORMATS = ("deepseek_v3_1", "deepseek_r1", "deepseek_v3_2", "deepseek_v4", "glm_4_6", "glm_4_7", "ling3", "laguna",
           "kimi_k2", "kimi_k3", "minimax_m1", "minimax_m2", "minimax_m3", "seed_oss", "nemotron_v2", "muse_glimmer")
REPLIES = [c for f in FAMILIES for c in data_cases(f) if c["tools"]]
UNWRAPS = {"kimi_k3", "muse_glimmer"}  # formats whose parser unwraps the answer's own markup


@pytest.mark.parametrize("name", FORMATS)
def test_every_cut_parses_and_no_call_loses_no_text(name):
    fmt = get_format(name)
    for case in REPLIES:
        ctx = context(case["tools"])
        text = case["input"]
        for cut in range(0, len(text) + 1, 3):
            content, calls = fmt.parse(text[:cut], ctx)
            if not calls and name not in UNWRAPS:
                assert content == text[:cut], (name, text[:cut])
            assert all(c.name in ctx.known for c in calls)


HOSTILE = {
    "glm_4_7": "<tool_call>f" + "<arg_key>k</arg_key><arg_value>v</arg_value>" * 4000,
    "deepseek_v3_2": "<｜DSML｜function_calls>\n" + '<｜DSML｜invoke name="f">\n' * 2000
                     + '<｜DSML｜parameter name="k" string="true">v</｜DSML｜parameter>\n' * 2000,
    "minimax_m2": "<minimax:tool_call>\n" + '<invoke name="f">\n<parameter name="k">v</parameter>\n' * 3000,
    "seed_oss": "<seed:tool_call>\n<function=f>\n" + "<parameter=k>v</parameter>\n" * 4000,
    "kimi_k3": "<|open|>response<|sep|>x<|open|>tools<|sep|>" + '<|open|>call tool="f" index="1"<|sep|>' * 3000,
    "minimax_m3": "]<]minimax[>[<tool_call>\n" + ']<]minimax[>[<invoke name="f">]<]minimax[>[<k>v' * 3000,
    "muse_glimmer": " to=f<|message|><|eom|>" * 4000,
    "kimi_k2": "<|tool_calls_section_begin|>" + "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{" * 3000,
    "deepseek_v3_1": "<｜tool▁calls▁begin｜>" + "<｜tool▁call▁begin｜>f<｜tool▁sep｜>{" * 3000,
    "minimax_m1": "<tool_calls>\n" + '{"name": "f", "arguments": {' * 3000,
    "nemotron_v2": "<TOOLCALL>[" * 20000 + "</TOOLCALL>" + "<TOOLCALL>{" * 20000,
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_long_unclosed_markup_parses_in_linear_time(name):
    ctx = context([{"type": "function", "function": {"name": "f", "parameters": {}}}])
    start = time.perf_counter()
    content, calls = get_format(name).parse(HOSTILE[name], ctx)
    assert time.perf_counter() - start < 2.0  # a backtracking regex takes minutes here
    kept = HOSTILE[name].removeprefix("<|open|>response<|sep|>") if name in UNWRAPS else HOSTILE[name]
    assert content == kept and not calls
