"""Every forced grammar of the formats in mistral3 ... solar_open also works behind the format's reasoning (the
server lets the thought through and constrains what follows it): a thought, then a call the grammar generated on
its own, is accepted and reads back."""

from __future__ import annotations

import dataclasses

import pytest

from edgeserve.text.formats import all_formats
from format_cases import PICK, accepts, context, random_reply, vocabulary

NAMES = ("magistral", "mistral3", "cohere2moe", "command_r7b", "command_r_plus", "functionary_v31",
         "functionary_v32", "firefunction_v2", "granite", "apertus", "apriel15", "apriel16", "gigachat3", "gigachat31",
         "minicpm5", "hunyuan3", "solar_open")
FORMATS = [f for f in all_formats() if f.name in NAMES]


def test_every_format_is_registered():
    assert sorted(f.name for f in FORMATS) == sorted(NAMES)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    specials = {t for f in FORMATS for t in f.forced([PICK], None, True).tokens}
    # reasoning tags that are one token in their vocabularies (Apriel's are plain text)
    specials |= {tag for f in FORMATS if f.reasoning for tag in f.reasoning
                 if tag and not any(c.isspace() for c in tag)}
    return vocabulary(tmp_path_factory.mktemp("forced"), tuple(sorted(specials)))


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
def test_forced_call_after_the_reasoning(tok, fmt):
    plain = fmt.forced([PICK], None, False)
    reply = random_reply(tok, plain, seed=7)
    content, calls = fmt.parse(reply, context([PICK]))
    assert content == "" and len(calls) == 1 and calls[0].name == "pick", reply
    if fmt.reasoning is None:
        return
    opened, closed = fmt.reasoning
    spec = dataclasses.replace(plain, think=(opened, closed))
    assert accepts(tok, spec, f"{opened}Let me pick.{closed}{reply}")
    assert accepts(tok, spec, reply)  # the thought is optional
    assert not accepts(tok, spec, f"{opened}Let me pick.{closed}Red.")
