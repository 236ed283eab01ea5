"""Chat templates: rendering identical to transformers, the sandbox, and where templates are found."""

from __future__ import annotations

import json

import pytest

from edgeserve.errors import ChatTemplateError, EdgeserveError, ModelLoadError
from edgeserve.loaders.chat_template import (
    CHATML_TEMPLATE,
    ChatTemplate,
    chat_template_from_gguf,
    chat_template_from_hf_folder,
)
from edgeserve.loaders.gguf_file import GGUFFile

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, with ünïcödé and 日本語 and\nnew lines."},
    ],
    [
        {"role": "system", "content": ""},
        {"role": "user", "content": "  spaced  "},
        {"role": "assistant", "content": "ok"},
    ],
]

# A template in the style of Qwen2.5's: tools as JSON, namespace(), loop controls, whitespace control.
TOOLS_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are helpful.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}{{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if message.role == 'system' %}{% continue %}{% endif %}
    {%- if message.role not in ['user', 'assistant'] %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- if ns.turns > 10 %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city <in °C> & more",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def template(default_model_path) -> ChatTemplate:
    return chat_template_from_gguf(GGUFFile(default_model_path).metadata)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_real_template_matches_transformers(template, reference_tokenizer, conversation, add_generation_prompt):
    expected = reference_tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert template.render(conversation, add_generation_prompt=add_generation_prompt) == expected


def test_real_template_tokens(template):
    assert not template.is_fallback
    assert (template.bos_token, template.eos_token) == ("<|im_start|>", "<|im_end|>")


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_tools_template_matches_transformers(reference_tokenizer, conversation, tools):
    expected = reference_tokenizer.apply_chat_template(
        conversation, tools=tools, chat_template=TOOLS_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert ChatTemplate(TOOLS_TEMPLATE, "<|im_start|>", "<|im_end|>").render(conversation, tools=tools) == expected


def test_raise_exception_becomes_chat_template_error():
    with pytest.raises(ChatTemplateError, match="^Unknown role: robot$") as info:
        ChatTemplate(TOOLS_TEMPLATE).render([{"role": "robot", "content": "beep"}])
    assert isinstance(info.value, EdgeserveError)


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{{ cycler.__init__.__globals__.os.system('touch {marker}') }}",
        "{{ lipsum.__globals__['os'].system('touch {marker}') }}",
        "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
        "{{ raise_exception.__globals__ }}",
    ],
)
def test_sandbox_blocks_escapes(source, tmp_path):
    marker = tmp_path / "escaped"
    template = ChatTemplate(source.replace("{marker}", str(marker)))
    with pytest.raises(ChatTemplateError, match="refused by the sandbox"):
        template.render([{"role": "user", "content": "hi"}])
    assert not marker.exists()


def test_template_mutates_only_its_own_copies():
    """Lists may be appended to (Kimi K2's template queues tool-call ids), but never the caller's messages."""
    messages = [{"role": "user", "content": "hi"}]
    source = ("{% set ns = namespace(ids=[]) %}{% set _ = ns.ids.append('a') %}{% set _ = messages.append(1) %}"
              "{{ ns.ids | tojson }} {{ messages | length }} {{ messages[:1] | map(attribute='role') | tojson }}")
    assert ChatTemplate(source).render(messages) == '["a"] 2 ["user"]'
    assert messages == [{"role": "user", "content": "hi"}]


def test_syntax_error_is_chat_template_error():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_template_bug_is_chat_template_error():
    with pytest.raises(ChatTemplateError, match="TypeError"):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render([{"role": "user", "content": "hi"}])


def test_tojson_does_not_escape_html_and_extra_variables_reach_template():
    source = "{{ tools | tojson }}|{{ enable_thinking }}|{{ bos_token }}|{{ documents is none }}"
    assert ChatTemplate(source, "<s>").render([], tools=[{"a": "<é>"}], enable_thinking=False) == (
        '[{"a": "<é>"}]|False|<s>|True'
    )


def test_generation_tag_is_accepted():
    source = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    assert ChatTemplate(source).render([{"role": "assistant", "content": "x"}]) == "x"


def test_chatml_fallback():
    template = chat_template_from_gguf({"tokenizer.ggml.tokens": ["a"]})
    assert template.is_fallback and template.source == CHATML_TEMPLATE
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "U"}, {"type": "image_url", "image_url": {}}]},
    ]
    assert template.render(messages) == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert template.render(messages, add_generation_prompt=False).endswith("U<|im_end|>\n")


def test_gguf_named_template():
    meta = {"tokenizer.chat_template": "A", "tokenizer.chat_template.tool_use": "B", "tokenizer.ggml.tokens": ["x"]}
    assert chat_template_from_gguf(meta, "tool_use").render([]) == "B"
    with pytest.raises(ModelLoadError):
        chat_template_from_gguf(meta, "rag")


# ------------------------------------------------------------------------------------------------------------------
# Hugging Face folders


def _config(**extra) -> str:
    return json.dumps({"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>", **extra})


def test_hf_folder_string_template(tmp_path, template):
    (tmp_path / "tokenizer_config.json").write_text(_config(chat_template=template.source))
    loaded = chat_template_from_hf_folder(tmp_path)
    assert (loaded.bos_token, loaded.eos_token) == ("<s>", "</s>")
    for conversation in CONVERSATIONS:
        assert loaded.render(conversation) == template.render(conversation)


def test_hf_folder_named_templates(tmp_path):
    named = [{"name": "default", "template": "D{{ bos_token }}"}, {"name": "tool_use", "template": "T"}]
    (tmp_path / "tokenizer_config.json").write_text(_config(chat_template=named))
    assert chat_template_from_hf_folder(tmp_path).render([]) == "D<s>"
    assert chat_template_from_hf_folder(tmp_path, "tool_use").render([]) == "T"
    with pytest.raises(ModelLoadError, match="rag"):
        chat_template_from_hf_folder(tmp_path, "rag")


def test_hf_folder_jinja_file_wins(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(_config(chat_template="from config"))
    (tmp_path / "chat_template.jinja").write_text("from file {{ eos_token }}")
    assert chat_template_from_hf_folder(tmp_path).render([]) == "from file </s>"


def test_hf_folder_saved_by_transformers(tmp_path, reference_tokenizer, template):
    reference_tokenizer.save_pretrained(tmp_path)
    loaded = chat_template_from_hf_folder(tmp_path)
    assert loaded.source == template.source
    assert (loaded.bos_token, loaded.eos_token) == (template.bos_token, template.eos_token)


def test_hf_folder_without_template_falls_back(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(_config())
    assert chat_template_from_hf_folder(tmp_path).is_fallback
