"""Chat templates: a model's Jinja template turned into a prompt string, as transformers renders it.

Templates come with the model and are untrusted code, so they run in Jinja's sandbox (mutable, as llama.cpp's
engine is: Kimi K2's template appends to its own lists; each render gets fresh copies of the request's data) with
the same settings and helpers as transformers' `apply_chat_template` (`trim_blocks`, `lstrip_blocks`,
`loopcontrols`, `raise_exception`, a `tojson` that does not HTML-escape, `strftime_now`), and reaching
for an underscore attribute such as `__class__` stops rendering with a `ChatTemplateError`.

A model that ships no template gets `CHATML_TEMPLATE`:

    <|im_start|>{role}\\n{content}<|im_end|>\\n   (per message)
    <|im_start|>assistant\\n                       (when add_generation_prompt)
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import SandboxedEnvironment

from edgeserve.errors import ChatTemplateError, ModelLoadError

from .tokenizer import hf_special_tokens, load_json_if_exists

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Gemma's turn format (Google's Gemma 2/3 template, text parts only): used for a Gemma GGUF without a template.
# A system message is folded into the first user turn, as Gemma has no system role.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = (messages[0]['content'] if messages[0]['content'] is string "
    "else messages[0]['content'][0]['text']) + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


class _RaisedByTemplate(TemplateError):
    """What the template's own `raise_exception(message)` raises."""


def _raise_exception(message: str) -> None:
    raise _RaisedByTemplate(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys,
                      default=_json_sequence)


def _json_sequence(value: Any) -> list:
    """A filter's lazy result (`tools | map(attribute='function')`) as the list it stands for, for `tojson`."""
    if isinstance(value, Iterator):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's `namespace()`, refusing underscore names so a template cannot plant dunder attributes."""

    def __init__(*args: Any, **kwargs: Any):  # same signature trick as Jinja's, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates may not set underscore attribute {name!r} on a namespace")


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without exposing the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _GenerationTag(jinja2.ext.Extension):
    """Accepts transformers' `{% generation %}...{% endgeneration %}` (assistant-mask markers) as a no-op."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _Environment(SandboxedEnvironment):
    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        # The stock sandbox returns an Undefined that prints as '' -- fail loudly instead.
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _environment() -> _Environment:
    env = _Environment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace, dict=_Dict())
    return env


_ENV = _environment()


def _plain(value: Any) -> Any:
    """`value` rebuilt from plain JSON types; anything else becomes an inert '<TypeName>' string."""
    return json.loads(json.dumps(value, default=lambda o: f"<{type(o).__name__}>"))


class ChatTemplate:
    """A model's chat template, compiled once and rendered per request."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", *, is_fallback: bool = False):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.is_fallback = is_fallback  # True when the model had no template and CHATML_TEMPLATE stands in
        # the tokenizer's named "tool_use" template (Hermes 2 Pro / 3, Command R): what requests with tools render
        self.tool_use: ChatTemplate | None = None
        try:
            self._template = _ENV.from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"the model's chat template does not compile: {e}") from None
        self._reads_parts: bool | None = None  # whether it reads content only as a list of parts (_wants_parts)
        self._system_ok: bool | None = None  # whether it renders a system message (accepts_system)
        self._object_args: bool | None = None  # whether it renders call arguments given as an object

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt for `messages` (dicts with 'role' and 'content'); `extra` reaches the template as
        variables (e.g. tools=[...], documents=[...], enable_thinking=False)."""
        messages = _plain(messages)
        if self._wants_parts():  # string content as one text part
            messages = [{**m, "content": [{"type": "text", "text": m["content"]}]}
                        if isinstance(m, dict) and isinstance(m.get("content"), str) else m for m in messages]
        context = {
            "tools": None,  # passed explicitly, as transformers does: templates test `tools is not none`
            "documents": None,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **_plain(extra),
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**context)
        except _RaisedByTemplate as e:
            raise ChatTemplateError(str(e)) from None
        except SecurityError as e:
            raise ChatTemplateError(f"chat template refused by the sandbox: {e}") from None
        except Exception as e:  # a template bug or an unexpected message shape: still the request's problem
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None

    def _wants_parts(self) -> bool:
        """Whether the template drops string content and prints only a list of content parts (SmolVLM's and
        Idefics3's iterate `message['content']` as parts): decided once, by rendering a probe both ways."""
        if self._reads_parts is None:
            probe = "edgeserve-probe-7f3a9c"

            def shows(content: Any) -> bool:
                try:
                    out = self._template.render(messages=[{"role": "user", "content": content}], tools=None,
                                                documents=None, bos_token=self.bos_token, eos_token=self.eos_token,
                                                add_generation_prompt=True)
                except Exception:
                    return False
                return probe in out

            self._reads_parts = not shows(probe) and shows([{"type": "text", "text": probe}])
        return self._reads_parts

    def accepts_system(self) -> bool:
        """Whether the template renders a system message (Gemma 2's refuses one): decided once, by rendering one."""
        if self._system_ok is None:
            try:
                self.render([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
                self._system_ok = True
            except ChatTemplateError:
                self._system_ok = False
        return self._system_ok

    def accepts_object_arguments(self) -> bool:
        """Whether the template renders an assistant call whose arguments are an object (as HF templates expect);
        one that concatenates them as text (functionary v3.2's `'\\n' + arguments`) does not: decided once, by
        rendering a probe call both ways (False only when the object fails and the text renders)."""
        if self._object_args is None:
            def renders(arguments: Any) -> bool:
                call = {"id": "a1b2c3d4e", "type": "function", "function": {"name": "probe_fn", "arguments": arguments}}
                messages = [{"role": "user", "content": "u"},
                            {"role": "assistant", "content": "", "tool_calls": [call]},
                            {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "r"},
                            {"role": "user", "content": "u"}]
                tools = [{"type": "function", "function": {"name": "probe_fn", "parameters": {"type": "object"}}}]
                try:
                    self.render(messages, tools=tools)
                except ChatTemplateError:
                    return False
                return True

            self._object_args = renders({"probe_key": "probe_value"}) or not renders('{"probe_key": "probe_value"}')
        return self._object_args

    def __repr__(self) -> str:
        return f"ChatTemplate({len(self.source)} chars, fallback={self.is_fallback})"


def _pick(templates: Any, where: str) -> str | None:
    """The default template from a string or from transformers' list of {'name', 'template'} form."""
    if templates is None or isinstance(templates, str):
        return templates
    if isinstance(templates, list):
        named = {t.get("name"): t.get("template") for t in templates if isinstance(t, dict)}
        if "default" not in named:
            raise ModelLoadError(f"{where} has no chat template named 'default' (has: {', '.join(map(str, named))})")
        return named["default"]
    raise ModelLoadError(f"{where}: chat_template is neither a string nor a list of named templates")


TEMPLATE_KEY = "tokenizer.chat_template"  # GGUF metadata; named templates are TEMPLATE_KEY + ".<name>"
TOOL_USE = "tool_use"  # the name of a tokenizer's template for requests with tools (as transformers picks it)


def chat_template_from_gguf(metadata: Mapping[str, Any], name: str | None = None) -> ChatTemplate:
    """The template in `tokenizer.chat_template` (or `tokenizer.chat_template.<name>`); if absent, Gemma's for a
    Gemma model, else ChatML."""
    key = TEMPLATE_KEY + (f".{name}" if name else "")
    source = metadata.get(key)
    if name and source is None:
        raise ModelLoadError(f"GGUF metadata has no {key}")
    tokens = metadata.get("tokenizer.ggml.tokens") or []

    def token(id_key: str) -> str:
        i = metadata.get(f"tokenizer.ggml.{id_key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else ""

    bos, eos = token("bos_token_id"), token("eos_token_id")
    # (Gemma 4 has turn markers of its own: its files carry their template; without one, ChatML stands in)
    if not source and str(metadata.get("general.architecture", "")) in ("gemma", "gemma2", "gemma3"):
        return ChatTemplate(GEMMA_TEMPLATE, bos, eos)
    if not source:
        return ChatTemplate(CHATML_TEMPLATE, bos, eos, is_fallback=True)
    template = ChatTemplate(source, bos, eos)
    tool_use = metadata.get(f"{TEMPLATE_KEY}.{TOOL_USE}") if not name else None
    if isinstance(tool_use, str) and tool_use:
        template.tool_use = ChatTemplate(tool_use, bos, eos)
    return template


def chat_template_from_hf_folder(path: str | os.PathLike[str], name: str | None = None) -> ChatTemplate:
    """The template of a Hugging Face folder: chat_template.jinja, else tokenizer_config.json's
    `chat_template` (string or named list), else chat_template.json; ChatML if none has one. Its `tool_use`
    template (the named list's, or additional_chat_templates/tool_use.jinja) comes along as `.tool_use`."""
    template = _hf_template(Path(path), name)
    if not name and not template.is_fallback:
        tool_use = _hf_named_source(Path(path), TOOL_USE)
        if tool_use:
            template.tool_use = ChatTemplate(tool_use, template.bos_token, template.eos_token)
    return template


def _hf_template(folder: Path, name: str | None) -> ChatTemplate:
    bos, eos = (t or "" for t in hf_special_tokens(folder))
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file() and not name:
        try:
            return ChatTemplate(jinja_file.read_text(encoding="utf-8"), bos, eos)
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"cannot read {jinja_file}: {e}") from None
    if name:
        source = _hf_named_source(folder, name)
        if source:
            return ChatTemplate(source, bos, eos)
        raise ModelLoadError(f"{folder} has no chat template named {name!r}")
    for file in ("tokenizer_config.json", "chat_template.json"):
        source = _pick(load_json_if_exists(folder / file).get("chat_template"), str(folder / file))
        if source:
            return ChatTemplate(source, bos, eos)
    return ChatTemplate(CHATML_TEMPLATE, bos, eos, is_fallback=True)


def _hf_named_source(folder: Path, name: str) -> str | None:
    """The source of a folder's template called `name`: additional_chat_templates/<name>.jinja, else the entry of
    that name in tokenizer_config.json's / chat_template.json's list of named templates; None when there is none."""
    extra = folder / "additional_chat_templates" / f"{name}.jinja"
    if extra.is_file():
        try:
            return extra.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"cannot read {extra}: {e}") from None
    for file in ("tokenizer_config.json", "chat_template.json"):
        templates = load_json_if_exists(folder / file).get("chat_template")
        if isinstance(templates, list):
            named = {t.get("name"): t.get("template") for t in templates if isinstance(t, dict)}
            if isinstance(named.get(name), str) and named[name]:
                return named[name]
    return None
