"""Tiny GGUF models that follow a script: each scripted token is always followed by the next one, whatever the
context, so a test knows exactly what the model generates (tool calls, reasoning) through the real engine.

How: every attention output and FFN down projection is zero, so the last hidden state is the last token's
embedding; scripted tokens get orthonormal embeddings and the output row of a token is the (scaled) embedding of
the token before it in the script. The scripted pieces are user-defined vocabulary entries, decoded as their text.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from support.gguf_vocab import byte_vocab
from support.gguf_writer import finish

from edgeserve.bench.random_gguf import add_stack_keys

NEWLINE = "Ċ"  # the byte-level symbol of "\n": the last token of a ChatML generation prompt


def _add_script_tokenizer(w, script: list[tuple[str, str]], specials: list[str]) -> dict[str, int]:
    """A byte-level gpt2 vocabulary into writer `w`: `specials` (control), the bytes, one merge ("he") and every
    piece of `script` that is neither (user-defined); {token: id}."""
    import gguf

    bytes_ = byte_vocab()
    pieces = []
    for a, b in script:
        for t in (a, b):
            if t not in specials and t not in bytes_ and t not in pieces:
                pieces.append(t)
    tokens = specials + bytes_ + ["he"] + pieces  # one merge: a BPE vocabulary needs at least one
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * len(specials) + [gguf.TokenType.NORMAL] * 257
                      + [gguf.TokenType.USER_DEFINED] * len(pieces))
    w.add_token_merges(["h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    return {t: i for i, t in enumerate(tokens)}


def _scripted_embeddings(script: list[tuple[str, str]], index: dict[str, int], hidden: int,
                         rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(token embeddings, output head): each scripted `a` embedded as its own orthonormal direction, which the head
    maps to a large logit for its `b`; the other tokens random."""
    vocab = len(index)
    involved = sorted({index[a] for a, _ in script})
    assert len(involved) <= hidden, "more scripted tokens than hidden dimensions"
    embd = rng.normal(0, 1, size=(vocab, hidden)).astype(np.float32)
    ortho = np.linalg.qr(rng.normal(size=(hidden, hidden)))[0].astype(np.float32)
    for k, i in enumerate(involved):
        embd[i] = ortho[k]
    out = np.zeros((vocab, hidden), dtype=np.float32)
    for a, b in script:
        out[index[b]] += 4.0 * ortho[involved.index(index[a])]  # logit ~ 4 * sqrt(hidden) = 32 over every other
    return embd, out


def write_scripted_gguf(path: Path, script: list[tuple[str, str]], template: str, arch: str = "llama",
                        hidden: int = 64, layers: int = 1, heads: int = 4, specials: tuple[str, ...] = (),
                        context: int = 512, noise: float = 0.0) -> Path:
    """A GGUF whose model, after token `a`, always picks `b`, for each (a, b) in `script` (`a` may be a byte
    symbol such as NEWLINE, or a piece of the script); pieces that are not byte symbols become vocabulary entries.
    `template` is its chat template; `specials` are more control tokens (after the three ChatML ones); `context`
    its context length in tokens; `noise`: the scale of random output weights added (a random-weight model where
    nothing is scripted)."""
    import gguf

    rng = np.random.default_rng(0)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *specials]
    w = gguf.GGUFWriter(str(path), arch)
    hd = hidden // heads
    add_stack_keys(w, layers, context, hidden, hidden * 2, heads, heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    index = _add_script_tokenizer(w, script, specials)
    w.add_chat_template(template)
    embd, out = _scripted_embeddings(script, index, hidden, rng)
    if noise:
        out += np.random.default_rng(1).normal(0, noise, size=out.shape).astype(np.float32)
    tensors = {"token_embd.weight": embd, "output.weight": out, "output_norm.weight": np.ones(hidden, np.float32)}
    for i in range(layers):
        p = f"blk.{i}."
        tensors.update({
            p + "attn_norm.weight": np.ones(hidden, np.float32), p + "ffn_norm.weight": np.ones(hidden, np.float32),
            p + "attn_q.weight": rng.normal(0, 0.1, (hidden, hidden)).astype(np.float32),
            p + "attn_k.weight": rng.normal(0, 0.1, (hidden, hidden)).astype(np.float32),
            p + "attn_v.weight": rng.normal(0, 0.1, (hidden, hidden)).astype(np.float32),
            p + "attn_output.weight": np.zeros((hidden, hidden), np.float32),
            p + "ffn_gate.weight": rng.normal(0, 0.1, (hidden * 2, hidden)).astype(np.float32),
            p + "ffn_up.weight": rng.normal(0, 0.1, (hidden * 2, hidden)).astype(np.float32),
            p + "ffn_down.weight": np.zeros((hidden, hidden * 2), np.float32),
        })
        if arch == "qwen3":
            tensors[p + "attn_q_norm.weight"] = np.ones(hd, np.float32)
            tensors[p + "attn_k_norm.weight"] = np.ones(hd, np.float32)
    for name, data in tensors.items():
        w.add_tensor(name, data)
    finish(w)
    return path


# Qwen-style (hermes) tool template: tools listed in the system turn, calls as <tool_call> JSON, results as
# <tool_response> in a user turn.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] %}<|im_start|>assistant\n{{ m['content'] }}"
    "{% for c in m['tool_calls'] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}{% if m['name'] %} name={{ m['name'] }}{% endif %}{{ '\\n' }}"
    "{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TOOL_CALL_JSON = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TOOL_SCRIPT = [(NEWLINE, "<tool_call>"), ("<tool_call>", TOOL_CALL_JSON), (TOOL_CALL_JSON, "</tool_call>"),
               ("</tool_call>", "<|im_end|>")]

# Qwen3-style thinking template: enable_thinking false closes an empty reasoning block in the prompt.
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}{% endif %}"
)
THOUGHT, ANSWER = "Let me think about it.", "The answer is 4."
THINK_SCRIPT = [(NEWLINE, "<think>"), ("<think>", THOUGHT), (THOUGHT, "</think>"), ("</think>", ANSWER),
                (ANSWER, "<|im_end|>")]
