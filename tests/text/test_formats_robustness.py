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
    "deepseek_v4": "<｜DSML｜function_calls>x</｜DSML｜function_calls>" * 20000,  # closed blocks, the other kind never
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


# --- forced calls from a model that picks tokens at random ---------------------------------------------------------

SPECIALS = {"deepseek_v3_1": "deepseek", "deepseek_r1": "deepseek", "deepseek_v3_2": "dsml", "deepseek_v4": "dsml",
            "kimi_k2": "kimi_k2", "kimi_k3": "kimi_k3", "minimax_m2": "minimax_m2", "minimax_m3": "minimax_m3",
            "glm_4_6": "glm", "glm_4_7": "glm", "ling3": "glm", "laguna": "glm", "seed_oss": "seed",
            "nemotron_v2": "nemotron", "muse_glimmer": "muse", "minimax_m1": None}
# number and boolean parameters only: a random walk through free text would rarely write its closing tag
RANDOM_TOOLS = [{"type": "function", "function": {"name": "set", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}, "on": {"type": "boolean"}}, "required": ["n", "on"]}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]


def _special_tokens(kind: str | None) -> tuple[str, ...]:
    from edgeserve.text.formats import deepseek, deepseek_dsml, glm, kimi, minimax, muse_glimmer, nemotron, seed_oss

    return {"deepseek": deepseek.TOKENS, "dsml": (deepseek_dsml.DSML,), "kimi_k2": kimi.K2_TOKENS,
            "kimi_k3": kimi.K3_TOKENS, "minimax_m2": minimax.M2_TOKENS, "minimax_m3": minimax.M3_TOKENS,
            "glm": glm.TOKENS, "seed": seed_oss.TOKENS, "nemotron": ("<TOOLCALL>", "</TOOLCALL>"),
            "muse": muse_glimmer.TOKENS, None: ()}[kind]


@pytest.mark.parametrize("name", FORMATS)
def test_a_random_model_under_the_forced_grammar_writes_calls_that_parse(tmp_path, name):
    import numpy as np

    from edgeserve.text.grammar import GrammarCompiler, allowed_mask
    from format_family_check import vocab

    tok = vocab(tmp_path, _special_tokens(SPECIALS[name]))
    fmt = get_format(name)
    compiler = GrammarCompiler.for_tokenizer(tok, tok.vocab_size)
    rng = np.random.default_rng(0)
    for choice, parallel in ((None, True), (None, False), ("set", True)):
        spec = fmt.forced(RANDOM_TOOLS, choice, parallel)
        for _ in range(3):
            state, ids = compiler.start(spec), []
            for _ in range(3000):
                allowed = allowed_mask([state], tok.vocab_size)[0].nonzero().flatten().tolist()
                if any(t in tok.eot_ids for t in allowed):
                    break  # the grammar may end here: a model that ends as soon as it may
                ids.append(int(rng.choice(allowed)))
                assert state.accept([ids[-1]])
            text = tok.decode(ids, skip_special_tokens=False)
            if name == "kimi_k3":  # the reply starts inside the thought the prompt opened
                text = text.split("<|close|>think<|sep|>", 1)[1]
            if name == "muse_glimmer" and text.startswith(" to=self"):
                text = text.split("<|eom|>", 1)[1]
            content, calls = fmt.parse(text, context(RANDOM_TOOLS))
            assert calls and content == "", text
            assert all(c.name == choice for c in calls) if choice else (parallel or len(calls) == 1), text
