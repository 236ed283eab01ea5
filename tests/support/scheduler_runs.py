"""Driving a Scheduler with a fake model, for the scheduler, window-pool and offload tests."""

from __future__ import annotations

from typing import Callable


def run_scheduler(sched, model, requests: dict, max_tokens: dict, arrivals: dict | None = None,
                  on_schedule: Callable | None = None, after_step: Callable | None = None) -> dict:
    """Drive `sched` with the fake `model` (`model.step(out)` -> sampled ids) until every request of `requests`
    ({id: prompt ids}) has its `max_tokens[id]` tokens, each added at its `arrivals` step (default 0); the pools'
    integrity checked every step, `on_schedule(out)` called before each update and `after_step()` after it.
    Returns {id: output ids}."""
    from edgeserve.engine.sched.scheduler import Sequence

    arrivals = arrivals or {sid: 0 for sid in requests}
    done: dict = {}
    for step in range(5000):
        for sid, at in arrivals.items():
            if at == step:
                sched.add(Sequence(sid, list(requests[sid])))
        if not sched.has_unfinished() and len(done) == len(requests):
            return done
        out = sched.schedule()
        if on_schedule is not None:
            on_schedule(out)
        sched.update(out, model.step(out))
        for s in out.scheduled:
            if len(sched.get(s.seq_id).output_token_ids) >= max_tokens[s.seq_id]:
                done[s.seq_id] = sched.finish(s.seq_id, "length").output_token_ids
        sched.block_manager.check_integrity()
        if after_step is not None:
            after_step()
    raise AssertionError("run did not finish")
