"""KV offload for a Qwen3.5 hybrid (issue 51): its recurrent-state snapshots travel with their KV blocks through the
host and disk tiers, so a conversation's next turn computes only the new tokens after the device evicted the turn,
after a restart (same disk folder) and after an unload and load; a damaged or missing state file is recomputed to
the same tokens; swap preemption carries the state; host, disk and device budgets hold. Every output is compared
with a cold run (prefix caching off), and the counters show which path was taken."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from edgeserve.engine.cache.kv_cache import kv_bytes_per_token
from edgeserve.llm import LLM
from edgeserve.offload.disk_tier import STATE_SUFFIX
from edgeserve.sampling_params import SamplingParams

from qwen35_helpers import VOCAB, gguf_path  # noqa: F401 (gguf_path: a fixture)

pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BS = 16


@pytest.fixture(scope="module")
def cold(gguf_path: Path) -> LLM:
    return LLM(str(gguf_path), dtype="float32", device="cpu", kv_cache_gb=0.01, enable_prefix_caching=False)


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=n).tolist()


def served(path: Path, disk: Path | None, **kw) -> LLM:
    """A freshly loaded model with KV offload (host tier, and the disk tier at `disk`): what `edgeserve serve
    --kv-offload cpu,disk` builds at start-up."""
    kw.setdefault("kv_cache_gb", 0.01)
    return LLM(str(path), dtype="float32", device="cpu", kv_offload="cpu,disk" if disk else "cpu",
               disk_kv_path=str(disk) if disk else None, **kw)


def run(llm: LLM, prompt: list[int]) -> tuple[list[int], int, int]:
    """Greedy output, prompt tokens computed, prompt tokens resumed from a state snapshot."""
    before = llm.engine.stats()
    out = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    after = llm.engine.stats()
    return (out, after.prompt_tokens_computed - before.prompt_tokens_computed,
            after.prompt_tokens_from_states - before.prompt_tokens_from_states)


def cold_out(cold: LLM, prompt: list[int]) -> list[int]:
    return cold.generate([prompt], GREEDY)[0].outputs[0].token_ids


def resumable(n_tokens: int) -> int:
    """Where a finished sequence of `n_tokens` (prompt + 12 outputs, the last never computed) left its latest
    snapshot: its last computed block boundary."""
    return (n_tokens - 1) // BS * BS


def test_a_conversation_resumes_after_restarts_from_the_disk_tier(gguf_path: Path, cold: LLM, tmp_path: Path) -> None:
    first = tokens(45, seed=1)
    a = served(gguf_path, tmp_path)
    assert a.engine.offload is not None and a.engine.offload.state_pool is a.engine.states.pool
    reply, computed, _ = run(a, first)
    assert computed == 45 and reply == cold_out(cold, first)
    a.close()  # the server's shutdown (or an unload) hands the cache down and writes it to disk
    assert len(list(tmp_path.rglob(f"*{STATE_SUFFIX}"))) == 2  # the prompt's and the latest snapshot

    second = first + reply + tokens(9, seed=2)
    b = served(gguf_path, tmp_path)  # a restart
    out, computed, from_states = run(b, second)
    assert from_states == resumable(45 + 12) == 48 and computed == len(second) - 48
    assert out == cold_out(cold, second)
    s = b.engine.stats().offload
    assert s.state_disk_hits == 1 and s.disk_hits == 3 and s.corrupt_blocks == 0
    b.close()

    third = second + out + tokens(5, seed=3)
    c = served(gguf_path, tmp_path)  # another restart: the second turn's state is on disk too
    out3, computed, from_states = run(c, third)
    assert from_states == resumable(len(second) + 12) and computed == len(third) - from_states
    assert out3 == cold_out(cold, third)


_FIRST_TURN = """
import json
from edgeserve.llm import LLM
from edgeserve.sampling_params import SamplingParams
llm = LLM({model!r}, dtype="float32", device="cpu", kv_cache_gb=0.01, kv_offload="cpu,disk", disk_kv_path={disk!r})
out = llm.generate([{prompt!r}], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
llm.close()  # what `edgeserve serve` does on its way out
print(json.dumps(out.outputs[0].token_ids))
"""


def test_the_next_turn_in_a_new_process_computes_only_the_new_tokens(gguf_path: Path, cold: LLM,
                                                                     tmp_path: Path) -> None:
    first = tokens(45, seed=40)
    script = _FIRST_TURN.format(model=str(gguf_path), disk=str(tmp_path), prompt=first)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                           (str(Path(__file__).parent), str(Path(__file__).parents[1])))})
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout.strip().splitlines()[-1])
    assert reply == cold_out(cold, first)
    second = first + reply + tokens(9, seed=41)
    out, computed, from_states = run(served(gguf_path, tmp_path), second)
    assert from_states == 48 and computed == len(second) - 48 and out == cold_out(cold, second)


def test_an_unloaded_and_reloaded_model_resumes(gguf_path: Path, cold: LLM, tmp_path: Path) -> None:
    """The server's unload (keep_alive) ends the engine's loop, which closes the core; a load builds a new one."""
    first = tokens(40, seed=4)
    a = served(gguf_path, tmp_path)
    reply, _, _ = run(a, first)
    a.engine.close()
    del a
    b = LLM.from_model(served(gguf_path, None).lm, kv_offload="cpu,disk", disk_kv_path=str(tmp_path),
                       kv_cache_gb=0.01)
    second = first + reply + tokens(7, seed=5)
    out, computed, from_states = run(b, second)
    assert from_states == 48 and computed == len(second) - 48 and out == cold_out(cold, second)


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_a_damaged_or_missing_state_file_is_recomputed_identically(gguf_path: Path, cold: LLM, tmp_path: Path,
                                                                   damage: str) -> None:
    first = tokens(45, seed=6)
    a = served(gguf_path, tmp_path)
    reply, _, _ = run(a, first)
    a.close()
    files = list(tmp_path.rglob(f"*{STATE_SUFFIX}"))
    assert len(files) == 2
    for f in files:
        if damage == "missing":
            f.unlink()
        else:
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0x01  # one bit of the state's payload
            f.write_bytes(bytes(data))
    second = first + reply + tokens(9, seed=7)
    b = served(gguf_path, tmp_path)
    out, computed, from_states = run(b, second)
    assert out == cold_out(cold, second)
    assert from_states == 0 and computed == len(second)  # the blocks are on disk, but no state to resume from
    s = b.engine.stats().offload
    assert s.state_disk_hits == 0 and s.corrupt_blocks == (2 if damage == "corrupt" else 0)
    b.close()  # recomputed states are written again: the next restart resumes
    third = second + out + tokens(5, seed=8)
    out3, _, from_states = run(served(gguf_path, tmp_path), third)
    assert from_states == resumable(len(second) + 12) and out3 == cold_out(cold, third)


def small_pool(lm, blocks: int, **kw) -> LLM:
    """An engine over `lm` whose device pool holds about `blocks` KV blocks beside 2 seats and 2 snapshots."""
    per = 9600  # one sequence's states (test_qwen35_engine checks the formula)
    budget = 4 * per + blocks * kv_bytes_per_token(lm.config, lm.model.dtype) * BS
    return LLM.from_model(lm, kv_cache_gb=budget / 2**30, max_num_seqs=2, **kw)


def test_states_evicted_from_the_device_come_back_from_the_host_tier(gguf_path: Path, cold: LLM) -> None:
    lm = served(gguf_path, None).lm
    llm = small_pool(lm, 12, kv_offload="cpu", cpu_kv_gb=0.01)
    assert llm.engine.states.budget.snapshots == 2
    first = tokens(45, seed=9)
    reply, _, _ = run(llm, first)
    for seed in range(10, 14):  # other conversations push the first one's blocks and snapshots off the device
        run(llm, tokens(40, seed=seed))
    s = llm.engine.stats().offload
    assert s.host_states >= 2 and s.host_blocks >= 3
    second = first + reply + tokens(9, seed=2)
    out, computed, from_states = run(llm, second)
    assert from_states == 48 and computed == len(second) - 48 and out == cold_out(cold, second)
    s = llm.engine.stats().offload
    assert s.state_host_hits == 1 and s.host_hits == 3
    assert s.host_bytes <= 0.01 * 2**30
    stats = llm.engine.stats()
    assert stats.kv_cache_bytes + stats.state_bytes <= llm.config.kv_cache_gb * 2**30
    llm.engine.states.check()


def test_swap_preemption_carries_the_state(gguf_path: Path, cold: LLM) -> None:
    """A pool of a few blocks: sequences are preempted, their KV and state swapped out and back, not recomputed."""
    ps = [tokens(n, seed=20 + n) for n in (20, 26, 31, 17)]
    alone = [cold_out(cold, p) for p in ps]
    lm = served(gguf_path, None).lm
    per = 9600
    budget = 8 * per + 5 * kv_bytes_per_token(lm.config, lm.model.dtype) * BS
    llm = LLM.from_model(lm, kv_cache_gb=budget / 2**30, max_num_seqs=4, enable_prefix_caching=False,
                         kv_offload="cpu", cpu_kv_gb=0.01)
    assert [r.outputs[0].token_ids for r in llm.generate(ps, GREEDY)] == alone
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.offload.swap_outs > 0
    assert stats.offload.swap_ins == stats.offload.swap_outs
    # swapped back, not recomputed: every prompt token was computed once
    assert stats.prompt_tokens_computed == sum(len(p) for p in ps)
    assert llm.engine.states.num_seated == 0 and llm.engine.offload.tiers.host.num_swapped == 0


def turn(body: list[int]) -> list[int]:
    """A chat turn: <|im_start|> (id 1 in the tiny vocabulary) ... <|im_end|> (id 2)."""
    return [1, *body, 2]


def test_a_rewritten_reply_still_resumes_after_the_turns_before_it(gguf_path: Path, cold: LLM) -> None:
    """An agent drops the previous reply's <think> part: the prompt differs from the last turn's inside that reply,
    and the state kept before that turn starts serves the system prompt and history."""
    llm = LLM.from_model(served(gguf_path, None).lm, kv_cache_gb=0.01)
    system, user1, user2 = turn(tokens(20, seed=30)), turn(tokens(15, seed=31)), turn(tokens(12, seed=32))
    think, answer = tokens(20, seed=33), tokens(10, seed=34)
    start = [1, 7, 8]  # <|im_start|>assistant\n
    first = system + user1 + turn(think + answer) + user2 + start
    run(llm, first)
    rewritten = system + user1 + turn(answer) + user2 + start
    reply_at = len(system) + len(user1)  # 39: the reply's turn starts there
    out, computed, from_states = run(llm, rewritten)
    assert from_states == reply_at // BS * BS == 32 and computed == len(rewritten) - 32
    assert out == cold_out(cold, rewritten)
    metrics = llm.engine.stats()
    assert metrics.prompt_tokens_from_states == 32


def test_the_server_resumes_a_conversation_after_keep_alive_unloads_the_model(gguf_path: Path,
                                                                               tmp_path: Path) -> None:
    """Through `edgeserve serve`'s own path: the unload ends the engine's loop (which writes the cache to disk), the
    next request loads the model again, and its prompt resumes from the first turn's state read back from disk."""
    import httpx

    from edgeserve.engine.config import EngineConfig
    from edgeserve.server import ServerConfig

    from server_helpers import metric, serve, wait_until

    engine = EngineConfig(kv_cache_gb=0.01, kv_offload="cpu,disk", disk_kv_path=str(tmp_path / "kv"))
    first = "hello there, " * 6
    with serve(ServerConfig(engine=engine, models=(str(gguf_path),), keep_alive=300, dtype="float32")) as s:
        name = gguf_path.stem
        with httpx.Client(base_url=s.url, timeout=120) as c:
            def generate(prompt: str, **kw) -> dict:
                r = c.post("/api/generate", json={"model": name, "prompt": prompt, "raw": True, "stream": False,
                                                  "options": {"num_predict": 12, "temperature": 0}, **kw})
                assert r.status_code == 200, r.text
                return r.json()

            one = generate(first, keep_alive=0)  # unloaded once it has answered
            assert wait_until(lambda: not c.get("/api/ps").json()["models"], timeout=60)
            two = generate(first + one["response"] + " and now?")
            served_states = metric(c.get("/metrics").text, "edgeserve_prompt_tokens_from_states", f'model="{name}"')
    assert list((tmp_path / "kv").rglob(f"*{STATE_SUFFIX}"))
    # the second prompt resumed at the first prompt's last full block, whose state came back from disk (the reply's
    # text is re-tokenized, so the first turn's later snapshot need not match)
    assert served_states == (one["prompt_eval_count"] - 1) // BS * BS == 48
    assert two["prompt_eval_count"] > one["prompt_eval_count"] + 12


def test_a_damaged_block_under_a_good_state_is_recomputed_identically(gguf_path: Path, cold: LLM,
                                                                       tmp_path: Path) -> None:
    """The state after block 3 is whole but block 2's KV file is not: the hit cannot reach the state, so the engine
    looks again from the blocks that did come back (none of which has a state) and recomputes."""
    from edgeserve.engine.cache.kv_blocks import block_hash

    first = tokens(45, seed=50)
    a = served(gguf_path, tmp_path)
    reply, _, _ = run(a, first)
    a.close()
    disk = a.engine.offload.tiers.disk
    conversation = first + reply
    parent, paths = b"", []
    for i in range(3):
        parent = block_hash(parent, conversation[i * BS:(i + 1) * BS])
        paths.append(disk.path(parent))
    assert all(p.exists() for p in paths) and disk.states.path(parent).exists()
    data = bytearray(paths[1].read_bytes())
    data[-3] ^= 0x10
    paths[1].write_bytes(bytes(data))
    second = conversation + tokens(9, seed=51)
    b = served(gguf_path, tmp_path)
    out, computed, from_states = run(b, second)
    assert out == cold_out(cold, second)
    assert from_states == 0 and computed == len(second)
    s = b.engine.stats().offload
    assert s.corrupt_blocks == 1 and s.state_disk_hits == 1  # the state was read, then found unusable
    b.engine.states.check()
    b.engine.scheduler.block_manager.check_integrity()
