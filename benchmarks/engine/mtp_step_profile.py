"""Where a speculative MTP step's time goes (issue 50): process (CPU) time of each part of a step, per step and per
generated token, for plain decoding and for MTP at a forced acceptance (benchmarks/engine/mtp_oracle.py's oracle).

Parts, timed by wrapping the functions that do them (one thread: OMP_NUM_THREADS=1 makes process time the work):
the trunk's forward by the number of rows it ran (so a verified step's k + 1 rows and a hybrid's recomputed rows
show apart: the cost of one more row is the slope), the full-vocabulary logits, the head's block (`mtp_forward`),
its draft logits, the hybrid state backup / restore, verification, and the rest (Python: scheduling, sampling,
bookkeeping) as the step total less the parts.

    OMP_NUM_THREADS=1 python benchmarks/engine/mtp_step_profile.py [--shape qwen35-0.8b] [--ks 2,3] [--accept 0.7]
        [--max-tokens 48] [--rounds 2] [--out /tmp/folder] [--head-ab REPS]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from dataclasses import dataclass, field

from mtp_oracle import VOCAB, oracle_for, plain_run, write_model


@dataclass
class Clock:
    """Process time and calls per part of one side, collected by the wrappers `instrument` puts in."""

    time: dict[str, float] = field(default_factory=lambda: collections.defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))


class Clocks:
    """The side being run now (`current`) and `wrap`, which times a function into its clock."""

    current: Clock | None = None

    def wrap(self, owner, name: str, part, label=None) -> None:
        """Time `owner.name` under `part` (or `label(args)`'s part, from the call's arguments)."""
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.current is not None:
                    key = label(args) if label else part
                    self.current.time[key] += time.process_time() - start
                    self.current.calls[key] += 1

        setattr(owner, name, timed)


def instrument(clock: Clocks, lm) -> None:
    """Wrap the parts of a step of `lm`'s engines (the model object and the modules the engine calls through)."""
    from edgeserve.engine.cache import state_cache
    from edgeserve.engine.spec import mtp as spec_mtp
    from edgeserve.engine.runner import model_runner
    from edgeserve.engine.spec import speculator

    model = lm.model
    clock.wrap(model, "forward", None, label=lambda a: f"trunk {a[0].shape[0]} rows")
    clock.wrap(model, "logits", None, label=lambda a: f"logits {a[0].shape[0]} rows")
    clock.wrap(spec_mtp, "mtp_forward", "head block")
    clock.wrap(spec_mtp, "draft_logits", "head draft logits")
    clock.wrap(spec_mtp, "mtp_logits", "head full logits")
    clock.wrap(state_cache.StateSlots, "backup", "state backup", label=lambda a: "state backup")
    clock.wrap(state_cache.StateSlots, "restore", "state restore", label=lambda a: "state restore")
    clock.wrap(speculator.Speculator, "verify", "verify", label=lambda a: "verify")
    clock.wrap(model_runner.ModelRunner, "replay", "draft replay", label=lambda a: "draft replay")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen35-0.8b")
    ap.add_argument("--mix", default="Q4_K_M")
    ap.add_argument("--ks", default="2,3")
    ap.add_argument("--accept", type=float, default=0.7)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-replay", action="store_true",
                    help="also each k with the state backup / restore and recompute (Engine.set_draft_replay(False))")
    ap.add_argument("--head-ab", type=int, default=0,
                    help="instead: the head's block on one draft row, fused against per-op, this many alternating reps")
    a = ap.parse_args()

    from pathlib import Path

    from edgeserve import LLM
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    lm = load_model(resolve(str(write_model(a.shape, a.mix, None, VOCAB, Path(a.out) if a.out else None))))
    if a.head_ab:
        return head_ab(lm, a.head_ab)
    opts = dict(kv_cache_gb=0.1, max_num_seqs=1, enable_prefix_caching=False)
    prompt, params, plain, reference = plain_run(lm, a.max_tokens, opts)
    engines = {"plain": plain}
    for k in (int(x) for x in a.ks.split(",")):
        llm = LLM.from_model(lm, speculative="mtp", num_speculative_tokens=k, **opts)
        llm.engine.spec.mtp.oracle = oracle_for(prompt, reference, a.accept, lm.config.vocab_size)
        llm.engine.spec.backoff = None
        engines[f"mtp k={k} a={a.accept:.0%}"] = llm
        if a.no_replay:
            llm = LLM.from_model(lm, speculative="mtp", num_speculative_tokens=k, **opts)
            llm.engine.spec.mtp.oracle = oracle_for(prompt, reference, a.accept, lm.config.vocab_size)
            llm.engine.spec.backoff = None
            llm.engine.set_draft_replay(False)
            engines[f"mtp k={k} a={a.accept:.0%} no replay"] = llm
    clocks = {side: Clock() for side in engines}
    for side, llm in engines.items():  # warm-up (plans, draft vocabulary) outside the clocks
        llm.generate([prompt], params)
    switch = Clocks()
    instrument(switch, lm)
    totals: dict[str, list[float]] = {side: [] for side in engines}
    for _ in range(a.rounds):
        for side, llm in engines.items():
            switch.current = clocks[side]
            steps = llm.engine.num_steps
            start = time.process_time()
            out = llm.generate([prompt], params)[0].outputs[0].token_ids
            totals[side].append(time.process_time() - start)
            switch.current = None
            clocks[side].calls["steps"] += llm.engine.num_steps - steps
            assert out == reference, side
    for side, clock in clocks.items():
        tokens = a.max_tokens * a.rounds
        total = sum(totals[side])
        parts = {k: round(1000 * v / tokens, 2) for k, v in sorted(clock.time.items())}
        rest = total - sum(clock.time.values())  # the parts do not nest (draft logits are outside mtp_forward)
        print(json.dumps({"shape": a.shape, "side": side, "cpu_ms_per_token": round(1000 * total / tokens, 2),
                          "steps_per_token": round(clock.calls["steps"] / tokens, 3),
                          "ms_per_token": parts, "rest_ms_per_token": round(1000 * rest / tokens, 2),
                          "ms_per_call": {k: round(1000 * v / clock.calls[k], 2) for k, v in sorted(clock.time.items())},
                          "calls": dict(sorted(clock.calls.items())),
                          "median_cpu_s_per_run": round(statistics.median(totals[side]), 3)}))


def head_ab(lm, reps: int) -> None:
    """Process time of the head's block (`mtp_forward`) on one draft row after a 32-row context, its fused one-layer
    plan against per-op, sides alternating `reps` times; prints the medians and their ratio as JSON."""
    import torch

    from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention
    from edgeserve.kernels.dispatch import AttentionMetadata
    from edgeserve.models.mtp_head import head_decoder, mtp_forward

    model, head = lm.model, lm.model.mtp
    fused = head_decoder(model, head)
    assert fused is not None, "the head's block does not fit the fused stack"
    pool = KVPool(head.kv_config, 4, 16, model.dtype, model.device)
    hidden = torch.randn(33, lm.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(model.dtype)
    ids = torch.randint(1000, 20000, (33,), generator=torch.Generator().manual_seed(1))

    def run(native) -> float:
        head.native = native
        meta = AttentionMetadata.build([32], [32], [[0, 1, 2, 3]], list(range(32)))
        mtp_forward(model, head, ids[:32], hidden[:32], torch.arange(32), PagedKVAttention(pool, meta))
        meta = AttentionMetadata.build([1], [33], [[0, 1, 2, 3]], [32])
        start = time.process_time()
        mtp_forward(model, head, ids[32:], hidden[32:], torch.tensor([32]), PagedKVAttention(pool, meta))
        return time.process_time() - start

    times: dict[str, list[float]] = {"fused": [], "per-op": []}
    for _ in range(reps):
        times["fused"].append(run(fused))
        times["per-op"].append(run(None))
    head.native = fused
    med = {side: statistics.median(t) * 1000 for side, t in times.items()}
    print(json.dumps({"head_block_ms_per_draft_row": {k: round(v, 3) for k, v in med.items()},
                      "per_op_over_fused": round(med["per-op"] / med["fused"], 2), "reps": reps}))


if __name__ == "__main__":
    main()
