"""Our own chat-format data cases (tests/data/chat_formats/*.json of the formats in mistral3, cohere, functionary,
granite, apertus, apriel, gigachat, minicpm5, hunyuan, solar_open) read back with the detected format's parser: the
template is rendered as a request would render it, to know whether its prompt opened the thought."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgeserve.loaders.chat_template import ChatTemplate
from edgeserve.text.formats import detect_format
from format_cases import split, templates

FILES = ("mistral3", "cohere", "functionary", "granite", "apertus", "apriel", "gigachat", "minicpm5", "hunyuan",
         "solar_open")
DATA = Path(__file__).parent / "data" / "chat_formats"
CASES = [(f"{name}[{i}]", case) for name in FILES
         for i, case in enumerate(json.loads((DATA / f"{name}.json").read_text()))]


@pytest.mark.parametrize("label, case", CASES, ids=[label for label, _ in CASES])
def test_data_case_reads_back(label, case):
    source = templates()[case["template"]]
    fmt = detect_format(source)
    extra = {} if case["enable_thinking"] is None else {"enable_thinking": case["enable_thinking"]}
    # firefunction's template reads `functions` (its tools as JSON) and `datetime`, which llama.cpp supplies
    extra.update(functions=json.dumps(case["tools"]), datetime="2026-01-01 00:00:00")
    prompt = ChatTemplate(source).render([{"role": "user", "content": "What time is it in Paris?"}],
                                         add_generation_prompt=True, tools=case["tools"] or None, **extra)
    tags = fmt.reasoning or ("<think>", "</think>")
    opened = bool(tags[0].strip()) and prompt.rstrip().endswith(tags[0].strip())
    content, reasoning, calls = split(fmt, case["input"], case["tools"], opened, tags)
    expect = case["expect"]
    assert (content, reasoning) == (expect["content"], expect["reasoning_content"])
    assert [(n, a) for n, a, _ in calls] == [(c["name"], json.loads(c["arguments"])) for c in expect["tool_calls"]]
    assert [i for (_, _, i), c in zip(calls, expect["tool_calls"]) if c["id"]] == \
        [c["id"] for c in expect["tool_calls"] if c["id"]]
