"""Templates of this batch whose models write another family's call syntax: StepFun 3.5 Flash and Nemotron 3 Nano
(Qwen3-Coder's XML calls: "qwen3_coder"), QwQ-32B and MiMo-VL (`<tool_call>` JSON: "hermes"). Their llama.cpp
expectations and our own cases (tests/data/chat_formats/{stepfun,nemotron3,qwq,mimo_vl}.json) run through the
format each template is detected as; they are skipped until that format is registered (the port of the existing
formats into edgeserve.text.formats brings them)."""

from __future__ import annotations

import pytest

from edgeserve.text.formats import all_formats
from format_family_check import case_id, check_case, data_cases, same, template_source

FAMILIES = {"stepfun": "qwen3_coder", "nemotron3": "qwen3_coder", "qwq": "hermes", "mimo_vl": "hermes"}
CASES = [(fmt, case) for family, fmt in FAMILIES.items() for case in data_cases(family)]


def _registered(name: str) -> bool:
    return any(f.name == name for f in all_formats())


@pytest.mark.parametrize("fmt, case", CASES, ids=[case_id(c) for _, c in CASES])
def test_reads_what_llama_cpp_reads(fmt, case):
    if not _registered(fmt):
        pytest.skip(f"the {fmt!r} format is not registered yet")
    assert next(f.name for f in all_formats() if f.detect(template_source(case["template"]))) == fmt
    got, want = check_case(case)
    assert same(got, want), (got, want)


@pytest.mark.parametrize("template", ["StepFun3.5-Flash.jinja", "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja",
                                      "Qwen-QwQ-32B.jinja", "MiMo-VL.jinja"])
def test_no_format_of_this_batch_claims_them(template):
    mine = {"deepseek_v3_1", "deepseek_r1", "deepseek_v3_2", "deepseek_v4", "glm_4_6", "glm_4_7", "ling3", "laguna",
            "kimi_k2", "kimi_k3", "minimax_m1", "minimax_m2", "minimax_m3", "seed_oss", "nemotron_v2", "muse_glimmer"}
    assert not [f.name for f in all_formats() if f.name in mine and f.detect(template_source(template))]
