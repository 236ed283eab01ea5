"""What the fused-native-stack tests of each architecture share: a LoadedModel around a bare model (a stub
tokenizer), running the same thing fused and per-op, and a hybrid's forward over ragged steps of paged K/V and
recurrent states."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch

from edgeserve.engine.cache.kv_cache import PagedKVAttention
from edgeserve.engine.cache.state_pool import StepStates
from edgeserve.kernels.dispatch import AttentionMetadata
from edgeserve.models.load import LoadedModel

BLOCK = 4  # the K/V block size of run_hybrid_steps' pools in these tests
# two prompts of 13 and 9 tokens (the first in chunks of 7 and 6, across blocks), decodes beside prompt chunks, then
# decodes of batch 2 and 1: per step, (start, stop) of each sequence's ids
STEPS = [[(0, 7), (0, 5)], [(7, 13), (5, 9)], [(13, 14), (9, 10)], [(14, 15), (10, 11)], [(15, 16), (0, 0)],
         [(16, 17), (11, 12)]]
IDS = [[1, 5, 17, 33, 2, 60, 7, 81, 100, 12, 250, 9, 44, 40, 41, 42, 43],
       [3, 90, 91, 92, 5, 6, 7, 8, 9, 10, 11, 12]]


def stub_loaded(model, name: str, folder: Path) -> LoadedModel:
    """`model` as a LoadedModel named `name` with a tokenizer that never ends a sequence and decodes to ""."""
    tokenizer = SimpleNamespace(eot_ids=frozenset(), decode=lambda ids: "", byte_fallback_ids=frozenset())
    return LoadedModel(name, SimpleNamespace(path=folder), model.config, model, tokenizer, None, 0.0)


def fused_and_per_op(model, run: Callable[[], list]) -> list:
    """`run()` with the model on its fused native stack, then on its per-op path (each time checked to be so): both
    outputs, fused first, asserted equal."""
    outputs = []
    for fused in (True, False):
        model._native = False if fused else None
        outputs.append(run())
        assert (model._native is not None) == fused
    assert outputs[0] == outputs[1]
    return outputs


def run_hybrid_steps(model, pool, states, steps: list, seqs: list[list[int]], block: int) -> list[torch.Tensor]:
    """The model's hidden states of each step over the K/V `pool` and the state pool `states` (sequence j owns blocks
    8j .. 8j + 7 and a slot of its own); steps: per step, (start, stop) of each sequence's ids."""
    slots = [states.allocate() for _ in seqs]
    hidden = []
    for step in steps:
        run = [(j, a, b) for j, (a, b) in enumerate(step) if b > a]
        toks = [t for j, a, b in run for t in seqs[j][a:b]]
        pos = [p for j, a, b in run for p in range(a, b)]
        slot_map = [(8 * j + p // block) * block + p % block for j, a, b in run for p in range(a, b)]
        meta = AttentionMetadata.build([b - a for _, a, b in run], [b for _, _, b in run],
                                       [list(range(8 * j, 8 * j + 8)) for j, _, _ in run], slot_map)
        cu = [0]
        for _, a, b in run:
            cu.append(cu[-1] + b - a)
        st = StepStates.build(states, cu, [slots[j] for j, _, _ in run])
        hidden.append(model.forward(torch.tensor(toks), torch.tensor(pos), PagedKVAttention(pool, meta, states=st)))
    return hidden
