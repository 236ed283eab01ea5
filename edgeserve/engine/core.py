"""EngineCore: the synchronous heart of the engine. Owns the scheduler, the KV pool and the model runner.

`step()` runs on a worker thread while the event loop works; requests added or aborted meanwhile are
queued under a lock and applied at the start of the next step, where an abort frees the blocks.

A step is two parts with one shape in every mode. `_launch`: schedule -> the forward -> sample the rows without
drafts (the result stays on the device, its copy to the host started) and verify the rows with drafts (plain
decoding is speculation with k = 0). `_apply`: the result on the host -> cut at stop token / max_tokens ->
detokenize and match stop strings (a stop string ends its request here, before the next step is scheduled) ->
outputs. Without overlap a step is launch N, apply N; with overlap (`overlap`, on by default on CUDA) it is launch
N+1, then apply N, so the GPU always has the next step queued while the host works. A sequence whose last token is
still on the device carries a placeholder id; the next launch takes the real id from the device (`TokenFill`). A
request that ends at step N was already launched in N+1: that row's result is dropped. A launch that needs the
previous tokens on the host (penalties, grammars, a speculative proposal, aborts) applies the previous step first.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from edgeserve.errors import EdgeserveError, QueueFullError
from edgeserve.kernels.transfer import HostCopy, take_rows
from edgeserve.models.encoder_threads import intra_op_threads
from edgeserve.models.load import LoadedModel
from edgeserve.models.mrope import MRopePositions
from edgeserve.offload.engine_glue import build_pool_offload
from edgeserve.sampling_params import SamplingParams
from edgeserve.text.grammar import GrammarCompiler

from .runner.adapters import AdapterChoice, AdapterStore, prefix_key_for
from .config import EngineConfig
from .runner.cuda_graphs import DecodeGraphs, graphs_supported
from .cache.kv_cache import KVPool, engine_kv_format, size_pool
from .sched.thinking_budget import ThinkingBudget, ThinkingState
from .runner.model_runner import ModelRunner, TokenFill
from .sched.output_processor import OutputProcessor
from .cache.prefix_key import NO_KEY, PrefixKey
from .sched.request_check import check_images, check_mrope, check_request, check_spans, output_budget
from .outputs import EngineStats, RequestOutput, TokenLogprob, TokenOutput
from .runner.sampler import SampleOutput, SamplingRow, make_generator, sample_rows, token_logprobs
from .sched.request_state import AttendSpan, ImageRows, Registry, Request, SeqStatus
from .sched.scheduler import Scheduler, SchedulerOutput
from .cache.snapshot_points import turn_marker_ids
from .cache.state_cache import StateSlots
from .cache.state_pool import state_spec_for
from .spec import Speculator, is_assistant, speculative_method

log = logging.getLogger("edgeserve.engine")

_ids = itertools.count()

PLACEHOLDER = -1  # an output token whose id is still on the device (one-step overlap)
NONFINITE = ("the model's logits became non-finite (inf or NaN) while decoding, so no token could be chosen; "
             "with a LoRA adapter, its weights or scale are too large")


@dataclass
class Launched:
    """A launched step: what was scheduled, and each sampling row's result on its way to the host.

    Every row is speculation with k drafts: a row with k = 0 samples one token, kept on the device (`sample`,
    being copied to the host) until `apply`; a row with drafts was verified at launch (the verdict is read on the
    host there), so its tokens are known.
    """

    sched: SchedulerOutput
    sampling: list[Request]  # the sampling requests, in the step's batch order
    out_index: dict[str, int]  # request id -> index of its first new token in its outputs
    plain: list[int] = field(default_factory=list)  # rows of `sampling` sampled by `sample`, in its order
    sample: SampleOutput | None = None  # the plain rows' tokens on the device (for the next step's TokenFill)
    copy: HostCopy | None = None  # ... and on their way to the host
    verified: dict[int, list[int]] = field(default_factory=dict)  # row -> its accepted drafts + next token
    replayed: bool = False  # a hybrid's drafts were kept off its states (and the accepted ones replayed)


class EngineCore:
    """Continuous batching over one model: add requests, call `step()` until none is left."""

    def __init__(self, lm: LoadedModel, config: EngineConfig = EngineConfig(), draft: LoadedModel | None = None) -> None:
        """`draft`: the loaded draft model for `speculative="draft"` (the caller loads it: `load_draft_model`);
        `config.speculative` "auto" becomes "mtp" where the model has an MTP head, else off."""
        self.lm = lm
        config = replace(config, speculative=speculative_method(config.speculative, lm, config.draft_model))
        self.config = config
        model = lm.model
        if lm.config.backbone_hidden_size:
            raise EdgeserveError(f"{lm.name} is a Gemma 4 assistant: it drafts for a Gemma 4 model (--draft), it "
                                 "does not run on its own")
        if draft is not None and draft.config.is_hybrid:
            raise ValueError(f"a hybrid draft model ({draft.config.architecture}) is not supported: its recurrent "
                             "state is not kept; use a draft model with attention layers only")
        num_blocks, window_blocks, self.max_model_len, state_budget, self.kv_budget = size_pool(lm, config)
        # MTP and assistant drafting read every step's hidden states, which a replayed CUDA graph does not keep
        use_graphs = (not config.enforce_eager and graphs_supported(model.device, lm.config)
                      and config.speculative != "mtp" and not is_assistant(draft))
        self._build_caches(num_blocks, window_blocks, state_budget, use_graphs)
        self.requests = Registry()  # every admitted request's state, shared with the scheduler and block manager
        self.scheduler = Scheduler(config.scheduler_config(), num_blocks,
                                   enable_prefix_caching=config.enable_prefix_caching, offload=self.offload,
                                   registry=self.requests, states=self.states)
        self.pool.attach(self.scheduler.block_manager)  # a sliding-window pool's blocks are kept there
        self.runner = ModelRunner(model, self.pool, config.max_num_seqs, self.max_model_len,
                                  max_num_tokens=config.max_num_batched_tokens, registry=self.requests,
                                  states=self.states.pool if self.states is not None else None)
        if use_graphs:  # decode steps replay CUDA graphs captured at bucketed batch sizes
            self.runner.graphs = DecodeGraphs(model, self.pool, config.max_num_seqs, self.max_model_len)
        # LoRA adapters requests may pick (--lora, or loaded at runtime); at most max_loras resident
        self.adapters = AdapterStore(lm.config, config.max_loras, model, config.lora_weights)
        for name, path in config.loras:
            self.adapters.register(name, path)
        self.spec: Speculator | None = None
        if config.speculative is not None:
            self.spec = Speculator(config.speculative, config.num_speculative_tokens, lm, num_blocks,
                                   config.block_size, draft, config.spec_draft_vocab)
            self.runner.keep_hidden = self.spec.needs_hidden
            self.spec.attach(self.pool, self.scheduler.block_manager)
            self.set_draft_replay(True)
        self.overlap = config.overlap == "on" or (config.overlap == "auto" and model.device.type == "cuda")
        self._inflight: Launched | None = None
        self._lock = threading.Lock()
        self._pending_add: list[Request] = []
        self._pending_finish: dict[str, str] = {}
        self.num_steps = 0
        self._decode_step: tuple[int, list[int]] | None = None  # this step's sequences and drafts, when it decodes only
        self.generation_tokens = 0
        self.num_requests_finished = 0
        self._stats = self._collect_stats()

    def _build_caches(self, num_blocks: int, window_blocks: int, state_budget: int | None, use_graphs: bool) -> None:
        """The KV pool, a hybrid model's state slots and the offload tiers behind them."""
        lm, config, model = self.lm, self.config, self.lm.model
        use_offload = config.offload_config().use_cpu
        # the sliding-window layers' own pool, unless offload tiers (which copy blocks of every layer) are on
        window_blocks = 0 if use_offload else min(window_blocks, num_blocks)
        self.pool = KVPool(lm.config, num_blocks, config.block_size, engine_kv_format(lm, config), model.device,
                           scratch_block=use_graphs, window_blocks=window_blocks)
        if use_offload and self.pool.window_k.shape[0]:
            raise ValueError("KV offload tiers copy one pool of every layer's K/V; this model's sliding-window "
                             "layers keep K/V of another head shape apart (Gemma 4): run it without --kv-offload")
        # a hybrid model's recurrent states: a seat per running sequence and prefix-cache snapshots (state_cache)
        self.states = StateSlots(state_spec_for(lm.config), state_budget,
                                 model.device) if state_budget is not None else None
        # KV tiers behind the pool (None when --kv-offload is none): evicted prefixes (and a hybrid's state snapshots)
        # move down, swaps go there
        kv_name = self.pool.kv_dtype if self.pool.kv_format.quantized else ""
        self.offload = build_pool_offload(config.offload_config(), lm, self.pool.k, self.pool.v, kv_name,
                                          self.states.pool if self.states is not None else None) \
            if use_offload else None
        if self.states is not None:
            self.states.offload = self.offload
            self.states.turn_markers = turn_marker_ids(lm.tokenizer)  # snapshots before each chat turn too

    # --- requests (any thread) ------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    prefix_key: PrefixKey = NO_KEY, adapter: str | None = None, adapter_scale: float = 1.0,
                    images: Sequence[ImageRows] = (), mrope: MRopePositions | None = None,
                    attend_spans: Sequence[AttendSpan] = ()) -> str:
        """Queue a request; raises PromptTooLongError, QueueFullError ('busy') or InvalidRequestError (a ValueError)
        now, not later (`check_request` is the one validation). `prefix_key`: what besides the tokens enters its
        prefix-cache keys (images); `adapter`: the name of the LoRA adapter it runs at `adapter_scale` (its
        digest and scale join the prefix key); `images`: (start, rows [n, hidden]) embeddings that replace the
        prompt's tokens start..start+n-1 (an image's placeholders); `mrope`: the prompt's M-RoPE positions (a Qwen-VL
        model's, with images: models.mrope); `attend_spans`: [start, end) prompt ranges whose tokens attend to each
        other both ways (Gemma 3's images; a prefill chunk never ends inside one)."""
        check_request(prompt_ids, params, self.lm.config.vocab_size, self.max_model_len)
        choice = self.adapters.acquire(adapter, adapter_scale) if adapter is not None else None
        try:
            return self._add(prompt_ids, params, request_id, prefix_key_for(prefix_key, choice), choice, images, mrope,
                             attend_spans)
        except BaseException:
            self.adapters.release(choice)
            raise

    def _add(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None, prefix_key: PrefixKey,
             choice: AdapterChoice | None, images: Sequence[ImageRows], mrope: MRopePositions | None,
             attend_spans: Sequence[AttendSpan] = ()) -> str:
        request_id = request_id or f"req-{next(_ids)}"
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.lm.tokenizer.eot_ids)
        req = Request(request_id, list(prompt_ids), params=params, generator=make_generator(params), stop_ids=stop_ids,
                      max_tokens=output_budget(params.max_tokens, len(prompt_ids), self.max_model_len),
                      proc=OutputProcessor(request_id, prompt_ids, params, self.lm.tokenizer), prefix_key=prefix_key,
                      adapter=choice, images=check_images(images, len(prompt_ids), self.lm.config.hidden_size),
                      mrope=check_mrope(mrope, len(prompt_ids), self.lm.config),
                      attend_spans=check_spans(attend_spans, len(prompt_ids)))
        if params.thinking is not None:
            req.thinking = ThinkingState(params.thinking)
        if params.grammar is not None:  # GrammarError (a ValueError) names what the grammar engine cannot do
            req.grammar = GrammarCompiler.for_tokenizer(self.lm.tokenizer, self.lm.config.vocab_size).start(params.grammar)
        with self._lock:
            if request_id in self.requests or any(r.request_id == request_id for r in self._pending_add):
                raise ValueError(f"duplicate request id {request_id!r}")
            if len(self.scheduler.waiting) + len(self._pending_add) >= self.config.max_waiting:
                raise QueueFullError()
            self._pending_add.append(req)
        return request_id

    def finish_request(self, request_id: str, reason: str = "abort") -> None:
        """End a request at the start of the next step (its blocks are freed there); unknown ids are ignored."""
        with self._lock:
            self._pending_finish[request_id] = reason

    def end_thinking(self, request_id: str, spec: ThinkingBudget) -> bool:
        """Close request `request_id`'s thought at its next step (engine/sched/thinking_budget.py; `spec` gives the tags
        for a request that runs without a budget); False when it is unknown, finished or already answering."""
        with self._lock:
            req = self.requests.get(request_id) or next((r for r in self._pending_add if r.request_id == request_id),
                                                        None)
            if req is None or req.status is SeqStatus.FINISHED:
                return False
            if req.thinking is None:
                req.thinking = ThinkingState.resume(spec, list(req.output_token_ids))
            return req.thinking.end_now()

    def has_work(self) -> bool:
        """Whether a step would do anything."""
        return bool(self.requests or self._pending_add or self._pending_finish or self._inflight)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests) + len(self._pending_add)

    # --- one step (the worker thread) ------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Apply queued adds and aborts, run one batch, sample, retire what finished (stop strings included);
        return each request's text delta."""
        start, self._decode_step = time.perf_counter(), None
        try:
            return [o for o in self._step() if o is not None]
        finally:
            if self._decode_step is not None:  # what drafting costs, measured (set only with speculation on)
                self.spec.record_step(*self._decode_step, time.perf_counter() - start)
            stats = self._collect_stats()
            with self._lock:
                self._stats = stats

    def _step(self) -> list[RequestOutput | None]:
        """Launch this step, then apply the previous one (overlap) or this one (no overlap)."""
        outputs = []
        if self._inflight is not None and self._must_apply_first():
            outputs += self._apply(self._pop_inflight())
        outputs += self._apply_pending()
        launched = self._launch() if self.requests else None
        if self._inflight is not None:
            outputs += self._apply(self._pop_inflight())
        if launched is None:
            return outputs
        self._advance(launched)
        outputs += self._retire_outgrown(launched.sched)
        if self.overlap:
            self._inflight = launched
        else:
            outputs += self._apply(launched)
        return outputs

    def _pop_inflight(self) -> Launched:
        launched, self._inflight = self._inflight, None
        return launched

    def _must_apply_first(self) -> bool:
        """Whether the in-flight step must be applied before the next launch: an abort is queued, or one of its
        one-token rows belongs to a request whose next launch reads its tokens on the host (penalties, a
        grammar's mask, a speculative proposal)."""
        with self._lock:
            if self._pending_finish:
                return True
        prev = self._inflight
        return any(r.params.penalized or r.grammar is not None or (r.thinking is not None and r.thinking.active)
                   or (self.spec is not None and self.spec.wants(r))
                   for r in (prev.sampling[i] for i in prev.plain))

    def _launch(self) -> Launched:
        """Schedule, run the forward, sample the one-token rows (on the device) and verify the rows with drafts
        (on the host)."""
        if self.spec is not None:
            # decoding requests, and hybrids' that compute accepted tokens again after a partly rejected step
            self.spec.propose([r for r in self.requests.values() if r.status is SeqStatus.RUNNING and (
                r.num_remaining == 1 or r.num_computed_tokens >= r.num_prompt_tokens)])
        sched = self.scheduler.schedule()
        self.num_steps += 1
        for seq_id in sched.preempted:  # requeued: their blocks went back to the pool
            self.runner.batch.remove(seq_id)
            if self.spec is not None:
                self.spec.free(seq_id)
        for s in sched.scheduled:
            req = self.requests[s.seq_id]
            if req.num_cached_tokens is None:
                req.num_cached_tokens = s.positions[0]
        scheduled = [s for s in sched.scheduled if s.samples]
        sampling = [self.requests[s.seq_id] for s in scheduled]
        if self.spec is not None and sched.scheduled and all(
                s.samples and s.num_new_tokens == 1 + s.num_spec for s in sched.scheduled):
            self._decode_step = (len(scheduled), [s.num_spec for s in scheduled if s.num_spec])  # no prompt rows
        out = Launched(sched, sampling, {r.request_id: r.num_output_tokens for r in sampling})
        fill = self._fill(sched) if self._inflight is not None else None
        out.replayed = self.runner.replays_now()
        if self.states is not None and not out.replayed:  # a hybrid's states before its drafts, for a rollback when
            # some are rejected (a copy of a few MB: on one torch thread on the CPU, which does not wait on busy
            # cores); where the plan keeps the drafts off the states, the accepted ones are replayed instead
            with intra_op_threads(1 if self.lm.model.device.type == "cpu" else None):
                for s in sched.scheduled:
                    if s.num_spec:
                        self.states.backup(s.seq_id)
        logits = self.runner.execute(sched, fill)
        if self.spec is not None and self.spec.needs_hidden:
            self.spec.observe(sched.scheduled, self.runner.hidden, self.requests)
        if logits is None:  # every sequence was mid-prefill
            return out
        ends = list(itertools.accumulate(1 + s.num_spec for s in scheduled))
        out.plain = [i for i, s in enumerate(scheduled) if not s.num_spec]
        spec = [i for i, s in enumerate(scheduled) if s.num_spec]
        if out.plain:
            rows = take_rows(logits, [ends[i] - 1 for i in out.plain])
            reqs = [sampling[i] for i in out.plain]
            out.sample = sample_rows(rows, [_sampling_row(r) for r in reqs])
            out.copy = HostCopy.start(out.sample)
        if spec:
            rows = [r for i in spec for r in range(ends[i] - 1 - scheduled[i].num_spec, ends[i])]
            verdicts = self.spec.verify(take_rows(logits, rows), [scheduled[i] for i in spec],
                                        [sampling[i] for i in spec])
            for i, toks in zip(spec, verdicts):
                # a speculative run may pass a stop token or max_tokens: it ends there, like token-by-token decoding
                req = sampling[i]
                n, _ = _cut(toks, req.stop_ids, req.max_tokens - req.num_output_tokens)
                out.verified[i] = toks[:n]
            if out.replayed:
                self._replay(sched, {scheduled[i].seq_id: len(toks) - 1 for i, toks in zip(spec, verdicts)})
        return out

    def _replay(self, sched: SchedulerOutput, accepted: dict) -> None:
        """Advance a hybrid's states by each sequence's accepted drafts (its step kept them all off the states)."""
        with intra_op_threads(1 if self.lm.model.device.type == "cpu" else None):
            self.runner.replay([accepted.get(s.seq_id, 0) for s in sched.scheduled])

    def set_draft_replay(self, on: bool) -> None:
        """Whether a hybrid's verification steps keep their drafts off the recurrent states and replay the accepted
        ones (where the model's plan can: the Gated DeltaNet stack on the CPU), instead of a state backup before
        the step and, after a rejection, a restore and the accepted tokens computed again. A switch for A/B
        benchmarks; on by default."""
        self.runner.replay_drafts = on and self.spec is not None and self.runner.can_replay_drafts()

    def _advance(self, launched: Launched) -> None:
        """Account for a launched step in the scheduler (after the previous step's ids replaced their placeholders,
        so full blocks are hashed with real ids); a one-token row's token is a placeholder until `_apply`."""
        self.scheduler.replays_drafts = launched.replayed
        with intra_op_threads(1 if self.lm.model.device.type == "cpu" else None):  # a hybrid's state restore
            self.scheduler.update(launched.sched, {r.request_id: launched.verified.get(i, [PLACEHOLDER])
                                                   for i, r in enumerate(launched.sampling)})
        if self.spec is not None:
            self.spec.rollback(launched.sampling)
        bm = self.scheduler.block_manager
        for i in launched.verified:  # rejected drafts' blocks went back to the pool
            seq_id = launched.sampling[i].request_id
            if bm.has_seq(seq_id):
                self.runner.batch.shrink(seq_id, len(bm.block_ids(seq_id)))

    def _fill(self, sched: SchedulerOutput) -> TokenFill | None:
        """Where this step's placeholders (last tokens of sequences in flight) take their ids from."""
        prev = self._inflight
        row_of = {prev.sampling[i].request_id: j for j, i in enumerate(prev.plain)}
        index, source, flat = [], [], 0
        for s in sched.scheduled:
            flat += s.num_new_tokens
            if s.samples and s.token_ids[-1] == PLACEHOLDER:
                index.append(flat - 1)
                source.append(row_of[s.seq_id])
        return TokenFill(index, source, prev.sample.token_ids) if index else None

    def _apply(self, launched: Launched) -> list[RequestOutput | None]:
        """A launched step's tokens on the host: replace the placeholders, cut at stop/length, emit text."""
        ids, lps, broken = [], [], []
        if launched.copy is not None:
            sample = launched.copy.wait()
            ids = sample.token_ids.tolist()
            lps = token_logprobs(sample, [launched.sampling[i].params.logprobs for i in launched.plain])
            broken = sample.nonfinite.tolist() if sample.nonfinite is not None else [False] * len(ids)
        plain = {i: j for j, i in enumerate(launched.plain)}
        outputs = []
        for i, req in enumerate(launched.sampling):
            k = launched.out_index[req.request_id]
            if self.requests.get(req.request_id) is not req:
                continue  # ended while the step ran: the row was wasted work
            if i in plain and broken[plain[i]]:  # never a normal stop: the model's numbers overflowed
                outputs.append(self._fail(req, NONFINITE))
                continue
            if i in plain:
                toks, lp = [ids[plain[i]]], lps[plain[i]]
                req.set_output(k, toks[0])
                lp = [lp] if lp is not None else None
            else:  # verified at launch (requests with drafts ask no logprobs)
                toks, lp = launched.verified[i], None
            self.generation_tokens += len(toks)
            n, reason = _cut(toks, req.stop_ids, req.max_tokens - k)
            if req.thinking is not None:
                req.thinking.accept(toks[:n])
            if req.grammar is not None:
                req.grammar.accept([t for t in toks[:n] if t not in req.stop_ids])
                if req.grammar.error:  # never a silent stop: the reply could not be kept valid
                    outputs.append(self._fail(req, f"the output grammar failed while decoding: "
                                                   f"{req.grammar.error.strip().splitlines()[0]}"))
                    continue
            outputs.append(self._emit(req, toks[:n], lp, reason))
        return outputs

    def _emit(self, req: Request, tokens: list[int], logprobs: list[TokenLogprob] | None,
              reason: str | None) -> RequestOutput | None:
        """The output of a request's new tokens, retiring it when `reason` ends it."""
        if reason is None:
            return self._output(req, tokens, logprobs)
        # the scheduler may have retired it already (it outgrew the pool while its last token was in flight)
        return self._retire(req, tokens, logprobs, reason, stop_reason=tokens[-1] if reason == "stop" else None)

    def _retire_outgrown(self, sched: SchedulerOutput) -> list[RequestOutput | None]:
        """Retire the requests the scheduler ended because they outgrew the whole pool."""
        return [self._retire(self.requests[seq_id], [], None, "length")
                for seq_id in sched.finished if seq_id in self.requests]

    def _apply_pending(self) -> list[RequestOutput | None]:
        with self._lock:
            adds, self._pending_add = self._pending_add, []
            finishes, self._pending_finish = self._pending_finish, {}
        for req in adds:
            self.scheduler.add(req)  # registers it (self.requests is the scheduler's registry)
        outputs = []
        for request_id, reason in finishes.items():
            req = self.requests.get(request_id)
            if req is not None:
                outputs.append(self._retire(req, [], None, reason))
        return outputs

    def _retire(self, req: Request, tokens: list[int], logprobs: list[TokenLogprob] | None, reason: str,
                stop_reason: int | None = None) -> RequestOutput | None:
        self._end(req, reason)
        return self._output(req, tokens, logprobs, reason, stop_reason)

    def _end(self, req: Request, reason: str) -> None:
        """Forget a request and free its blocks now: the one place a request ends, whichever way (a stop, a length,
        an abort, a failure, the scheduler having retired it already); a second call for the same request does
        nothing."""
        if self.requests.get(req.request_id) is not req:
            return
        if self.scheduler.has(req.request_id):
            self.scheduler.finish(req.request_id, reason)
        self.runner.batch.remove(req.request_id)
        if self.spec is not None:
            self.spec.free(req.request_id)
        self.adapters.release(req.adapter)
        del self.requests[req.request_id]
        self.num_requests_finished += 1

    def _output(self, req: Request, tokens: list[int], logprobs: list[TokenLogprob] | None,
                reason: str | None = None, stop_reason: int | None = None) -> RequestOutput | None:
        """The text delta of a request's new tokens (None when nothing is left to say); a stop string found here
        ends the request at once, so it takes no row in the next step."""
        out = TokenOutput(req.request_id, tokens, logprobs, reason, stop_reason,
                          num_prompt_tokens=req.num_prompt_tokens,
                          num_cached_tokens=req.num_cached_tokens or 0, num_output_tokens=req.num_output_tokens,
                          spec=replace(req.spec) if req.spec.verifications else None)
        try:
            delta = req.proc.process(out)
        except Exception as e:  # noqa: BLE001 - detokenizing one request's tokens failed: end it alone
            log.error("request %s failed while turning tokens into text", req.request_id, exc_info=e)
            return self._fail(req, "this request failed while turning tokens into text")
        if delta is not None and delta.finished and reason is None:
            self._end(req, "stop")  # a stop string
        return delta

    # --- failures --------------------------------------------------------------

    def _fail(self, req: Request, message: str) -> RequestOutput:
        """End one request on a failure of its own: its stream gets `message` as an error, the others go on."""
        log.warning("request %s failed: %s", req.request_id, message)
        self._end(req, "abort")
        req.proc.done = True
        return RequestOutput(req.request_id, "", [], None, "abort", error=message)

    def blame(self) -> list[str]:
        """After a failed step: the requests whose own sampling fails alone, retired here (call between steps).

        Each request's params and token history go through the sampler on one row of zero logits with a fresh
        generator (its own generator is left untouched, so the others' seeded draws stay reproducible). The
        requests that fail are ended; the caller tells their streams. Empty when no request is to blame.
        """
        from .runner.sampler import sample_tokens

        dev = self.lm.model.device
        vocab = self.lm.config.vocab_size
        culprits = []
        for req in list(self.requests.values()):
            try:
                out = sample_tokens(torch.zeros(1, vocab, device=dev), [req.params], [make_generator(req.params)],
                                    [req.prompt_token_ids], [[t for t in req.output_token_ids if t >= 0]])
                out.token_ids.tolist()
            except Exception:  # noqa: BLE001 - any failure of this request's own sampling
                culprits.append(req.request_id)
        for request_id in culprits:
            req = self.requests[request_id]
            if self.scheduler.has(request_id):
                self._retire(req, [], None, "abort")
            else:
                del self.requests[request_id]
        return culprits

    # --- state -----------------------------------------------------------------

    def abort_all(self) -> list[RequestOutput]:
        """End every request now (shutdown, or after a failed step); call between steps only."""
        self._inflight = None  # its tokens are dropped with their requests
        with self._lock:
            adds, self._pending_add = self._pending_add, []
            self._pending_finish.clear()
        outputs = [self._output(r, [], None, "abort") for r in adds]
        for req in list(self.requests.values()):
            if self.scheduler.has(req.request_id):
                outputs.append(self._retire(req, [], None, "abort"))
            else:
                del self.requests[req.request_id]
                outputs.append(self._output(req, [], None, "abort"))
        stats = self._collect_stats()
        with self._lock:
            self._stats = stats
        return [o for o in outputs if o is not None]

    def close(self) -> None:
        """Before shutdown: hand the pool's cached prefixes (and a hybrid's state snapshots) down to the offload tiers
        and write them to disk."""
        if self.offload is not None:
            self.scheduler.block_manager.offer_cached()
            if self.states is not None:
                self.states.offer_all()
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
            kv_cache_dtype=self.pool.kv_dtype,
            prompt_tokens_computed=bm.num_prompt_tokens_computed,
            prompt_tokens_reused=bm.num_prompt_tokens_reused,
            generation_tokens=self.generation_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_requests_finished=self.num_requests_finished,
            num_steps=self.num_steps,
            offload=self.offload.tiers.stats() if self.offload is not None else None,
            **(_spec_stats(self.spec) if self.spec is not None else {}),
            **(_state_stats(self.states) if self.states is not None else {}),
        )


def _sampling_row(req: Request) -> SamplingRow:
    """The sampler's view of a request; its token history only where a penalty reads it (no per-step copies)."""
    forced = req.thinking.forced() if req.thinking is not None else None
    if req.params.penalized:
        return SamplingRow(req.params, req.generator, req.prompt_token_ids, req.output_token_ids, req.grammar,
                           forced)
    return SamplingRow(req.params, req.generator, [], [], req.grammar, forced)


def _cut(tokens: list[int], stop_ids: frozenset[int], room: int) -> tuple[int, str | None]:
    """How many of a step's tokens to keep and why the request ends: at the first stop token ("stop"), or
    when `room` tokens are out ("length"), else all of them and None."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return i + 1, "stop"
        if i + 1 >= room:
            return i + 1, "length"
    return len(tokens), None


def _state_stats(states: StateSlots) -> dict:
    return dict(state_slots_total=states.budget.seats, state_slots_used=states.num_seated,
                state_snapshots=states.num_snapshots, state_snapshots_total=states.budget.snapshots,
                state_bytes=states.nbytes, prompt_tokens_from_states=states.counters.prompt_tokens_from_states)


def _spec_stats(spec: Speculator) -> dict:
    c = spec.counters
    return dict(spec_proposed_tokens=c.proposed, spec_accepted_tokens=c.accepted, spec_verifications=c.verifications,
                spec_acceptance_rate=c.acceptance_rate, spec_mean_accepted_length=c.mean_accepted_length)
