"""benchmarks/serve/hybrid_restart_turns.py's conversation: with --rewrite-think the client drops each earlier
turn's <think> block, so the next prompt leaves the previous one right after its user turn; without it each prompt
extends the one before. Pure text, no server."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("hybrid_restart_turns",
                                                  ROOT / "benchmarks" / "serve" / "hybrid_restart_turns.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_drop_think_removes_every_block_and_its_blank_lines():
    drop = _script().drop_think
    assert drop("<think>\nplan a b\n</think>\n\nthe answer") == "the answer"
    assert drop("a<think>x</think>b<think>\ny\n</think>\nc") == "abc"
    assert drop("no reasoning here") == "no reasoning here"


def test_plain_turns_extend_each_other():
    prompts = _script().conversation(4, 30, 12)
    assert all(p.endswith("<|im_start|>assistant\n") for p in prompts)
    assert all(nxt.startswith(p) for p, nxt in zip(prompts, prompts[1:]))


def test_rewritten_think_leaves_the_previous_prompt_after_its_user_turn():
    mod = _script()
    plain, think = mod.conversation(4, 30, 12), mod.conversation(4, 30, 12, think=True)
    gen = "<|im_start|>assistant\n<think>\n"
    assert all(p.endswith(gen) for p in think)
    for p, nxt in zip(think, think[1:]):
        user_end = p[:-len(gen)]  # the history up to the end of the user turn
        assert nxt.startswith(user_end) and not nxt.startswith(p)
        assert nxt[len(user_end):].startswith("<|im_start|>assistant\n") and "<think>" not in nxt[len(user_end):-len(gen)]
    # the same user turns and replies as the plain conversation: only the reasoning differs
    assert [p[:-len("<think>\n")] for p in think] == plain
