"""EngineCore: the synchronous heart of the engine. Owns the scheduler, the KV pool and the model runner.

`step()` runs on a worker thread while the event loop works; requests added or aborted meanwhile are
queued under a lock and applied at the start of the next step, where an abort frees the blocks.

One-step overlap (`overlap`, on by default on CUDA): a step is launched, then the previous step's sampled ids are
read on the host (waiting on an event, not the whole device), so the GPU always has the next step queued while the
host schedules, stop-checks and hands out tokens. A sequence whose last token is still on the device carries a
placeholder id; the next step takes the real id from the device (`TokenFill`), and the placeholder is replaced when
the ids land. A request that ends at step N was already scheduled in step N+1: that row's result is dropped. Steps
that need every token on the host (penalties, speculative decoding, aborts) land the previous step first.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass, field, replace

import torch

from edgeserve.errors import PromptTooLongError, QueueFullError
from edgeserve.kernels.transfer import HostCopy
from edgeserve.models.load import LoadedModel
from edgeserve.offload.engine_glue import build_pool_offload
from edgeserve.sampling_params import SamplingParams
from edgeserve.text.grammar import GrammarCompiler, GrammarState

from .config import EngineConfig
from .cuda_graphs import DecodeGraphs, graphs_supported
from .kv_cache import KVPool, free_memory_bytes, gpu_pool_budget, kv_bytes_per_token, pool_blocks_for_budget
from .model_runner import ModelRunner, SamplingRow, TokenFill
from .outputs import EngineStats, TokenLogprob
from .sampler import SampleOutput, make_generator
from .scheduler import Scheduler, SchedulerConfig, Sequence, SeqStatus
from .spec import Speculator

log = logging.getLogger("edgeserve.engine")

_ids = itertools.count()

PLACEHOLDER = -1  # an output token whose id is still on the device (one-step overlap)


@dataclass
class TokenOutput:
    """What one step produced for one request (token ids, before any text work)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None  # "stop" (end-of-turn / stop token), "length" or "abort"
    stop_reason: int | None = None  # the stop token id
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0


@dataclass(eq=False)
class Request:
    """One request's engine-side state."""

    request_id: str
    seq: Sequence
    params: SamplingParams
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    max_tokens: int  # params.max_tokens capped by the room left in the context
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache supplied at first admission
    grammar: GrammarState | None = None  # constrained decoding: advanced by every accepted token
    finish: list[tuple[str, str | None]] = field(default_factory=list)


@dataclass
class InFlight:
    """A launched step whose sampled ids have not been read on the host yet."""

    sampling: list[Request]  # the sampling requests, in the step's batch order
    copy: HostCopy  # the step's SampleOutput on its way to the host
    device_ids: torch.Tensor  # [B] its sampled ids on the device, for the next step's TokenFill
    out_index: dict[str, int] = field(default_factory=dict)  # request id -> its placeholder's index in the outputs


class EngineCore:
    """Continuous batching over one model: add requests, call `step()` until none is left."""

    def __init__(self, lm: LoadedModel, config: EngineConfig = EngineConfig(), draft: LoadedModel | None = None) -> None:
        """`draft`: the draft model for `speculative="draft"` (else loaded from `config.draft_model`)."""
        self.lm = lm
        self.config = config
        model = lm.model
        self.max_model_len = min(config.max_model_len or model.max_positions, model.max_positions)
        if config.kv_cache_gb:
            budget = config.kv_cache_gb * 2**30
        elif model.device.type == "cuda":  # what the device fraction leaves after weights and a warm-up step
            budget = gpu_pool_budget(model, lm.config, min(config.max_num_batched_tokens, self.max_model_len),
                                     config.max_num_seqs, config.block_size, config.gpu_memory_fraction)
        else:
            budget = config.kv_cache_fraction * free_memory_bytes(model.device)
        num_blocks, window_blocks = pool_blocks_for_budget(budget, lm.config, model.dtype, config.block_size,
                                                           config.max_num_seqs, config.max_num_batched_tokens)
        # more blocks than every seat filled to the full context can never be used
        blocks_per_seq = -(-self.max_model_len // config.block_size)
        num_blocks = min(num_blocks, blocks_per_seq * config.max_num_seqs)
        if num_blocks < 1:
            need = kv_bytes_per_token(lm.config, model.dtype) * config.block_size
            hint = (" (the GPU is full after the weights and a warm-up step: raise --gpu-memory-fraction or lower "
                    "--max-batched-tokens)" if model.device.type == "cuda" and not config.kv_cache_gb else "")
            raise ValueError(f"the KV cache budget of {budget / 2**20:.1f} MiB holds no block of "
                             f"{need / 2**20:.2f} MiB{hint}")
        if num_blocks < blocks_per_seq:
            # a request may not use more context than the pool holds
            self.max_model_len = num_blocks * config.block_size
        use_graphs = not config.enforce_eager and graphs_supported(model.device, lm.config)
        # the sliding-window layers' own pool, unless offload tiers (which copy blocks of every layer) are on
        window_blocks = 0 if config.offload_config().use_cpu else min(window_blocks, num_blocks)
        self.pool = KVPool(lm.config, num_blocks, config.block_size, model.dtype, model.device,
                           scratch_block=use_graphs, window_blocks=window_blocks)
        sched_config = SchedulerConfig(max_num_seqs=config.max_num_seqs,
                                       max_num_batched_tokens=config.max_num_batched_tokens,
                                       # preempted requests rejoin the queue on top of the core's own admission limit
                                       max_waiting=config.max_waiting + config.max_num_seqs, block_size=config.block_size)
        # KV tiers behind the pool (None when --kv-offload is none): evicted prefixes move down, swaps go there
        self.offload = build_pool_offload(config.offload_config(), lm, self.pool.k, self.pool.v)
        self.scheduler = Scheduler(sched_config, num_blocks, enable_prefix_caching=config.enable_prefix_caching,
                                   offload=self.offload)
        self.pool.attach(self.scheduler.block_manager)  # a sliding-window pool's blocks are kept there
        self.runner = ModelRunner(model, self.pool)
        if use_graphs:  # decode steps replay CUDA graphs captured at bucketed batch sizes
            self.runner.graphs = DecodeGraphs(model, self.pool, config.max_num_seqs, self.max_model_len)
        self.spec: Speculator | None = None
        if config.speculative is not None:
            if config.speculative == "draft" and draft is None and config.draft_model is not None:
                from edgeserve.models.load import load_model
                from edgeserve.registry import resolve

                draft = load_model(resolve(config.draft_model), device=str(model.device))
            self.spec = Speculator(config.speculative, config.num_speculative_tokens, lm, num_blocks,
                                   config.block_size, draft)
        self.overlap = config.overlap == "on" or (config.overlap == "auto" and model.device.type == "cuda")
        self._inflight: InFlight | None = None
        self._requests: dict[str, Request] = {}
        self._lock = threading.Lock()
        self._pending_add: list[Request] = []
        self._pending_finish: dict[str, str] = {}
        self.num_steps = 0
        self.generation_tokens = 0
        self.num_requests_finished = 0
        self._stats = self._collect_stats()

    # --- requests (any thread) ------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a request; raises PromptTooLongError, QueueFullError ('busy') or ValueError now, not later."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.lm.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise PromptTooLongError(f"the prompt has {len(prompt_ids)} tokens but the context is "
                                     f"{self.max_model_len} tokens, which leaves no room to generate")
        request_id = request_id or f"req-{next(_ids)}"
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.lm.tokenizer.eot_ids)
        req = Request(request_id, Sequence(request_id, list(prompt_ids)), params, make_generator(params), stop_ids,
                      max_tokens=min(params.max_tokens, self.max_model_len - len(prompt_ids)))
        if params.grammar is not None:  # GrammarError (a ValueError) names what the grammar engine cannot do
            req.grammar = GrammarCompiler.for_tokenizer(self.lm.tokenizer, vocab).start(params.grammar)
        with self._lock:
            if request_id in self._requests or any(r.request_id == request_id for r in self._pending_add):
                raise ValueError(f"duplicate request id {request_id!r}")
            if len(self.scheduler.waiting) + len(self._pending_add) >= self.config.max_waiting:
                raise QueueFullError()
            self._pending_add.append(req)
        return request_id

    def finish_request(self, request_id: str, reason: str = "abort") -> None:
        """End a request at the start of the next step (its blocks are freed there); unknown ids are ignored."""
        with self._lock:
            self._pending_finish[request_id] = reason

    def has_work(self) -> bool:
        """Whether a step would do anything."""
        return bool(self._requests or self._pending_add or self._pending_finish or self._inflight)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests) + len(self._pending_add)

    # --- one step (the worker thread) ------------------------------------------

    def step(self) -> list[TokenOutput]:
        """Apply queued adds and aborts, run one batch, sample, retire what finished; return per-request outputs."""
        try:
            return self._step()
        finally:
            stats = self._collect_stats()
            with self._lock:
                self._stats = stats

    def _step(self) -> list[TokenOutput]:
        outputs = []
        if self._inflight is not None and not self._can_overlap():
            outputs += self._land()
        outputs += self._apply_pending()
        if not self._requests:
            if self._inflight is not None:  # every row of it belongs to a request that has ended
                outputs += self._land()
            return outputs
        if self.spec is not None:
            self.spec.propose([r for r in self._requests.values()
                               if r.seq.status is SeqStatus.RUNNING and r.seq.num_remaining == 1])
        sched = self.scheduler.schedule()
        self.num_steps += 1
        if self.spec is not None:
            for seq_id in sched.preempted:
                self.spec.free(seq_id)
        for s in sched.scheduled:
            req = self._requests[s.seq_id]
            if req.num_cached_tokens is None:
                req.num_cached_tokens = s.positions[0]
        sampling = [self._requests[s.seq_id] for s in sched.scheduled if s.samples]
        rows = [SamplingRow(r.params, r.generator, r.seq.prompt_token_ids, r.seq.output_token_ids, r.grammar)
                for r in sampling]
        if self.overlap and self.spec is None:
            return outputs + self._launch(sched, sampling, rows)
        outputs += self._retire_outgrown(sched)
        if self.spec is not None and any(s.num_spec for s in sched.scheduled):
            tokens, logprobs = self.spec.sample(self.runner, sched, sampling)
        else:
            sample = self.runner.execute(sched, rows)
            if sample is None:
                self.scheduler.update(sched, {})
                return outputs
            tokens = [[t] for t in sample.token_ids.tolist()]
            logprobs = [[lp] if lp is not None else None
                        for lp in _logprobs(sample, [r.params.logprobs for r in sampling])]
        # a speculative run may pass a stop token or max_tokens: it ends there, like token-by-token decoding
        ends = [_cut(toks, req.stop_ids, req.max_tokens - len(req.seq.output_token_ids))
                for req, toks in zip(sampling, tokens)]
        tokens = [toks[:n] for toks, (n, _) in zip(tokens, ends)]
        for req, toks in zip(sampling, tokens):
            if req.grammar is not None:
                req.grammar.accept([t for t in toks if t not in req.stop_ids])
        self.scheduler.update(sched, {r.request_id: toks for r, toks in zip(sampling, tokens)})
        if self.spec is not None:
            self.spec.rollback(sampling)
        self.generation_tokens += sum(len(toks) for toks in tokens)
        for req, toks, lp, (n, reason) in zip(sampling, tokens, logprobs, ends):
            lp = lp[:n] if lp is not None else None
            outputs.append(self._emit(req, toks, lp, reason))
        return outputs

    def _emit(self, req: Request, tokens: list[int], logprobs: list[TokenLogprob] | None,
              reason: str | None) -> TokenOutput:
        """The output of a request's new tokens, retiring it when `reason` ends it."""
        if reason is None:
            return self._output(req, tokens, logprobs)
        # the scheduler may have retired it already (it outgrew the pool while its last token was in flight)
        return self._retire(req, tokens, logprobs, reason, stop_reason=tokens[-1] if reason == "stop" else None,
                            already_finished=not self.scheduler.has(req.request_id))

    def _retire_outgrown(self, sched) -> list[TokenOutput]:
        """Retire the requests the scheduler ended because they outgrew the whole pool."""
        return [self._retire(self._requests[seq_id], [], None, "length", already_finished=True)
                for seq_id in sched.finished if seq_id in self._requests]

    # --- one-step overlap --------------------------------------------------------

    def _can_overlap(self) -> bool:
        """Whether the next step may launch before the in-flight step's ids are on the host."""
        if not self.overlap or self.spec is not None:
            return False
        with self._lock:
            if self._pending_finish:
                return False
            adds = list(self._pending_add)
        # penalties and grammars read the previous token on the host before sampling the next
        return not any(r.params.penalized or r.params.grammar is not None
                       for r in itertools.chain(self._requests.values(), adds))

    def _launch(self, sched, sampling: list[Request], rows: list[SamplingRow]) -> list[TokenOutput]:
        """Launch this step, then land the previous one; this step's tokens are placeholders until it lands."""
        fill = self._fill(sched) if self._inflight is not None else None
        sample = self.runner.execute(sched, rows, fill)
        launched = None if sample is None else InFlight(sampling, HostCopy.start(sample), sample.token_ids)
        outputs = self._land() if self._inflight is not None else []
        outputs += self._retire_outgrown(sched)
        if launched is not None:
            for req in sampling:
                if self._requests.get(req.request_id) is req:
                    launched.out_index[req.request_id] = len(req.seq.output_token_ids)
        self.scheduler.update(sched, {r.request_id: [PLACEHOLDER] for r in sampling})
        self._inflight = launched
        return outputs

    def _fill(self, sched) -> TokenFill | None:
        """Where this step's placeholders (last tokens of sequences in flight) take their ids from."""
        prev = self._inflight
        row_of = {r.request_id: i for i, r in enumerate(prev.sampling)}
        index, source, flat = [], [], 0
        for s in sched.scheduled:
            flat += s.num_new_tokens
            if s.samples and s.token_ids[-1] == PLACEHOLDER:
                index.append(flat - 1)
                source.append(row_of[s.seq_id])
        return TokenFill(index, source, prev.device_ids) if index else None

    def _land(self) -> list[TokenOutput]:
        """Read the in-flight step's ids on the host: replace the placeholders, stop-check, emit."""
        prev, self._inflight = self._inflight, None
        sample = prev.copy.wait()
        ids = sample.token_ids.tolist()
        lps = _logprobs(sample, [r.params.logprobs for r in prev.sampling])
        outputs = []
        for i, req in enumerate(prev.sampling):
            k = prev.out_index.get(req.request_id)
            if k is None or self._requests.get(req.request_id) is not req:
                continue  # ended while the step ran: the row was wasted work
            tok = ids[i]
            req.seq.set_output(k, tok)
            self.generation_tokens += 1
            _, reason = _cut([tok], req.stop_ids, req.max_tokens - k)
            if req.grammar is not None and tok not in req.stop_ids:
                req.grammar.accept([tok])
            outputs.append(self._emit(req, [tok], [lps[i]] if lps[i] is not None else None, reason))
        return outputs

    def _apply_pending(self) -> list[TokenOutput]:
        with self._lock:
            adds, self._pending_add = self._pending_add, []
            finishes, self._pending_finish = self._pending_finish, {}
        for req in adds:
            self._requests[req.request_id] = req
            self.scheduler.add(req.seq)
        outputs = []
        for request_id, reason in finishes.items():
            req = self._requests.get(request_id)
            if req is not None:
                outputs.append(self._retire(req, [], None, reason))
        return outputs

    def _retire(self, req: Request, tokens: list[int], logprobs: list[TokenLogprob] | None, reason: str,
                stop_reason: int | None = None, already_finished: bool = False) -> TokenOutput:
        if not already_finished:
            self.scheduler.finish(req.request_id, reason)
        if self.spec is not None:
            self.spec.free(req.request_id)
        del self._requests[req.request_id]
        self.num_requests_finished += 1
        out = self._output(req, tokens, logprobs)
        out.finish_reason, out.stop_reason = reason, stop_reason
        return out

    def _output(self, req: Request, tokens: list[int], logprobs: list[TokenLogprob] | None) -> TokenOutput:
        return TokenOutput(req.request_id, tokens, logprobs, num_prompt_tokens=len(req.seq.prompt_token_ids),
                           num_cached_tokens=req.num_cached_tokens or 0,
                           num_output_tokens=len(req.seq.output_token_ids))

    # --- failures --------------------------------------------------------------

    def blame(self) -> list[str]:
        """After a failed step: the requests whose own sampling fails alone, retired here (call between steps).

        Each request's params and token history go through the sampler on one row of zero logits with a fresh
        generator (its own generator is left untouched, so the others' seeded draws stay reproducible). The
        requests that fail are ended; the caller tells their streams. Empty when no request is to blame.
        """
        from .sampler import sample_tokens

        dev = self.lm.model.device
        vocab = self.lm.config.vocab_size
        culprits = []
        for req in list(self._requests.values()):
            seq = req.seq
            try:
                out = sample_tokens(torch.zeros(1, vocab, device=dev), [req.params], [make_generator(req.params)],
                                    [seq.prompt_token_ids], [[t for t in seq.output_token_ids if t >= 0]])
                out.token_ids.tolist()
            except Exception:  # noqa: BLE001 - any failure of this request's own sampling
                culprits.append(req.request_id)
        for request_id in culprits:
            req = self._requests[request_id]
            if self.scheduler.has(request_id):
                self._retire(req, [], None, "abort")
            else:
                del self._requests[request_id]
        return culprits

    # --- state -----------------------------------------------------------------

    def abort_all(self) -> list[TokenOutput]:
        """End every request now (shutdown, or after a failed step); call between steps only."""
        self._inflight = None  # its tokens are dropped with their requests
        with self._lock:
            adds, self._pending_add = self._pending_add, []
            self._pending_finish.clear()
        outputs = [TokenOutput(r.request_id, [], None, "abort", num_prompt_tokens=len(r.seq.prompt_token_ids))
                   for r in adds]
        for req in list(self._requests.values()):
            if self.scheduler.has(req.request_id):
                outputs.append(self._retire(req, [], None, "abort"))
            else:
                del self._requests[req.request_id]
                outputs.append(self._output(req, [], None))
                outputs[-1].finish_reason = "abort"
        stats = self._collect_stats()
        with self._lock:
            self._stats = stats
        return outputs

    def close(self) -> None:
        """Before shutdown: hand the pool's cached prefixes down to the offload tiers and write them to disk."""
        if self.offload is not None:
            self.scheduler.block_manager.offer_cached()
            self.offload.tiers.flush()

    def stats(self) -> EngineStats:
        """The counters as of the end of the last step (safe to call from any thread while a step runs)."""
        with self._lock:
            stats = replace(self._stats)
            stats.num_waiting += len(self._pending_add)
        return stats

    def _collect_stats(self) -> EngineStats:
        bm = self.scheduler.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_blocks - bm.num_free_blocks,
            kv_blocks_cached=bm.num_cached_free_blocks,
            kv_block_size=bm.block_size,
            kv_cache_bytes=self.pool.nbytes,
            prompt_tokens_computed=bm.num_prompt_tokens_computed,
            prompt_tokens_reused=bm.num_prompt_tokens_reused,
            generation_tokens=self.generation_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_requests_finished=self.num_requests_finished,
            num_steps=self.num_steps,
            offload=self.offload.tiers.stats() if self.offload is not None else None,
            **(_spec_stats(self.spec) if self.spec is not None else {}),
        )


def _cut(tokens: list[int], stop_ids: frozenset[int], room: int) -> tuple[int, str | None]:
    """How many of a step's tokens to keep and why the request ends: at the first stop token ("stop"), or
    when `room` tokens are out ("length"), else all of them and None."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return i + 1, "stop"
        if i + 1 >= room:
            return i + 1, "length"
    return len(tokens), None


def _spec_stats(spec: Speculator) -> dict:
    c = spec.counters
    return dict(spec_proposed_tokens=c.proposed, spec_accepted_tokens=c.accepted, spec_verifications=c.verifications,
                spec_acceptance_rate=c.acceptance_rate, spec_mean_accepted_length=c.mean_accepted_length)


def _logprobs(sample: SampleOutput, wanted: list[int | None]) -> list[TokenLogprob | None]:
    """Each row's TokenLogprob, or None for rows that did not ask."""
    if sample.logprobs is None:
        return [None] * len(wanted)
    chosen = sample.logprobs.tolist()
    top_ids, top_lp = sample.top_ids.tolist(), sample.top_logprobs.tolist()
    return [
        None if n is None else TokenLogprob(sample.token_ids[i].item(), chosen[i], list(zip(top_ids[i][:n], top_lp[i][:n])))
        for i, n in enumerate(wanted)
    ]
