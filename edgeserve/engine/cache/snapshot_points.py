"""Where a hybrid model's prompt state is worth a snapshot (engine.cache.state_cache): before each chat turn and at the
prompt's last full block. Torch-free: the scheduler reads it."""

from __future__ import annotations

from collections.abc import Sequence

MAX_PROMPT_POINTS = 8  # a prompt's snapshot points at most (its last ones: the turns an agent comes back to)
LADDER_TOKENS = 4096  # a long prompt also gets a point every this many tokens (another question on one document)
TURN_START_TOKENS = ("<|im_start|>", "<|start_header_id|>", "<start_of_turn>")  # ChatML, Llama 3, Gemma


def turn_marker_ids(tokenizer) -> frozenset[int]:
    """The ids of the tokenizer's chat turn-start tokens (TURN_START_TOKENS it has)."""
    ids = (tokenizer.token_to_id(t) for t in TURN_START_TOKENS)
    return frozenset(i for i in ids if i is not None)


def prompt_snapshot_points(token_ids: Sequence[int], num_prompt: int, block_size: int,
                           markers: frozenset[int]) -> tuple[int, ...]:
    """Where a hybrid's prompt state is worth keeping, in tokens (block boundaries, ascending): before each chat turn
    the prompt starts (`markers`: its turn-start token ids), so a client that rewrites a later turn (drops a
    <think>, edits a reply) still resumes after the turns before it; every LADDER_TOKENS of a long prompt (a prompt
    that shares only a long start with this one); and the prompt's last full block that a repeat of the prompt can
    hit (the last prompt token is always computed); at most MAX_PROMPT_POINTS, the last ones."""
    points = {(num_prompt - 1) // block_size * block_size}
    points.update(p // block_size * block_size for p in range(LADDER_TOKENS, num_prompt, LADDER_TOKENS))
    if markers:
        points.update(p // block_size * block_size for p in range(1, num_prompt) if token_ids[p] in markers)
    points.discard(0)
    return tuple(sorted(points)[-MAX_PROMPT_POINTS:])
