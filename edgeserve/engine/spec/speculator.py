"""The engine's speculative decoding: proposes before a step, verifies after the target's forward, counts."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from edgeserve.engine.outputs import SpecCounters
from edgeserve.engine.sched.scheduler import ScheduledSeq
from edgeserve.models.encoder_threads import intra_op_threads
from edgeserve.models.load import LoadedModel

from .assistant import AssistantProposer, is_assistant
from .backoff import Backoff, StepCosts
from .draft import DraftProposer
from .mtp import MtpProposer, NoMtpHeadError, mtp_head_error
from .ngram import NgramProposer
from .verify import Verdict, greedy_verify, one_hot, token_probs, verify

if TYPE_CHECKING:
    from edgeserve.engine.sched.request_state import Request


# tokens proposed per sequence per step where none is asked for (`--spec-tokens`): for the MTP head and a Gemma 4
# assistant, from the oracle benchmarks (docs/perf-log/2026-11-to-12.md): a dense model's head 2 (well ahead of 1 at
# 70% and 100% acceptance, level with it at 40%, 3 no better than 2 at 70%), an MoE's 1 (ahead of 2 at 70% and 40%:
# each verification row adds its experts to the step's reads); 4 for the others
DEFAULT_NUM_TOKENS = {"mtp": 2, "mtp-moe": 1, "assistant": 1, "ngram": 4, "draft": 4}
# accepted tokens a hybrid's request may carry to recompute (its state went back before them when a later draft was
# rejected) and still draft on top of them; more: a step without drafts first (docs/perf-log/2026-11-to-12.md)
MAX_BACKLOG = 2
# token ids the MTP head drafts within (`--spec-draft-vocab`; 0: the whole vocabulary): its output head cut to the
# lowest ids costs a draft a fraction of the full head's read (docs/perf-log/2026-11-to-12.md)
DEFAULT_DRAFT_VOCAB = 32768
# the acceptance below which MTP drafting costs more than it saves until this engine has measured its own steps
# (benchmarks/engine/mtp_oracle.py, docs/perf-log/2026-11-to-12.md): a request under it pauses drafting (spec.backoff);
# then StepCosts.break_even, from the wall times of plain and drafting steps, replaces it
MTP_BREAK_EVEN = 0.5


def speculative_method(asked: str | None, target: LoadedModel, draft_model: str | None = None) -> str | None:
    """The speculation an engine over `target` runs for EngineConfig.speculative `asked`: None (off) for None / "off";
    for "auto", "draft" when a draft model is named, else "mtp" where the model has an MTP head, else None;
    NoMtpHeadError (one line) for "mtp" on a model without one."""
    if asked in (None, "off"):
        return None
    if asked == "auto":
        if draft_model is not None:
            return "draft"
        return "mtp" if mtp_head_error(target) is None else None
    if asked == "mtp" and (why := mtp_head_error(target)) is not None:
        raise NoMtpHeadError(why)
    return asked


def default_num_tokens(method: str, asked: int | None) -> int:
    """Tokens proposed per step: `asked`, else the method's default."""
    return asked if asked is not None else DEFAULT_NUM_TOKENS.get(method, 4)


class Speculator:
    """Proposes drafts for decoding requests (prompt lookup, a draft model or the target's MTP head) and verifies
    them in one target forward: `propose` before `Scheduler.schedule`, `observe` the target's hidden states after its
    forward (the MTP head reads them), `verify` for the rows with drafts (the others go to the plain sampler),
    `rollback` after `Scheduler.update`, `free` when a request ends or is preempted."""

    def __init__(self, method: str, num_tokens: int | None, target: LoadedModel, num_blocks: int, block_size: int,
                 draft: LoadedModel | None = None, draft_vocab: int | None = None) -> None:
        self.method = method
        kind = ("assistant" if is_assistant(draft) else "mtp-moe" if method == "mtp" and target.config.is_moe
                else method)
        self.num_tokens = default_num_tokens(kind, num_tokens)
        self.ngram = NgramProposer() if method == "ngram" else None
        self.draft: DraftProposer | AssistantProposer | None = None
        if method == "draft":
            if draft is None:
                raise ValueError("speculative 'draft' needs a draft model (draft_model / --draft-model)")
            # a Gemma 4 assistant drafts over the target's own K/V (`attach` gives it the pool)
            self.draft = (AssistantProposer(draft, target) if is_assistant(draft)
                          else DraftProposer(draft, target, num_blocks, block_size))
        self.mtp = MtpProposer(target, num_blocks, block_size, DEFAULT_DRAFT_VOCAB if draft_vocab is None
                               else draft_vocab) if method == "mtp" else None
        self.counters = SpecCounters()
        # the proposers' and verification's small tensor ops run on one torch thread on the CPU (as the runner's
        # small steps do): a vocabulary-wide op split over busy cores waits longer than it computes
        self.threads = 1 if target.model.device.type == "cpu" else None
        # MTP is on by default where a file has a head: a request whose drafts are rarely accepted stops drafting
        self.backoff = Backoff(MTP_BREAK_EVEN) if method == "mtp" else None
        self.costs = StepCosts()
        self.max_backlog = MAX_BACKLOG

    @staticmethod
    def wants(req: "Request") -> bool:
        """Whether a request speculates: it did not opt out, asks no logprobs (not supported here yet) and has no
        grammar (a constrained request draws its tokens one at a time, each under its grammar's mask) or live thinking
        budget (its closing tag is forced one token per step)."""
        return req.params.speculative and req.params.logprobs is None and req.grammar is None and (
            req.thinking is None or not req.thinking.active)

    def propose(self, reqs: list["Request"]) -> None:
        """Set `spec_token_ids` (and, with a draft model or the MTP head, `draft_probs`) of each decoding request
        (never more than its max_tokens leaves room for)."""
        with intra_op_threads(self.threads):
            self._propose(reqs)

    def _propose(self, reqs: list["Request"]) -> None:
        reqs = [r for r in reqs if self.wants(r)]
        if self.backoff is not None:
            reqs = [r for r in reqs if self.backoff.drafts_now(r.request_id)]
        ks = [min(self.num_tokens, r.max_tokens - r.num_output_tokens - 1) for r in reqs]
        # a hybrid's request whose last drafts were partly rejected recomputes its accepted tokens (state rollback);
        # past `max_backlog` of them it takes a step without drafts, which keeps them: drafts rejected again would
        # send its state back to the same point, and the rows to recompute would grow step after step
        ks = [0 if r.num_tokens - r.num_computed_tokens - 1 > self.max_backlog else k for r, k in zip(reqs, ks)]
        if self.ngram is not None:
            for r, k in zip(reqs, ks):
                r.spec_token_ids = self.ngram.propose(r.all_token_ids, k)
            return
        proposer = self.draft or self.mtp
        assert proposer is not None
        drafts, qs = proposer.propose(reqs, ks, [r.params for r in reqs],
                                        [r.generator for r in reqs])
        for r, d, q in zip(reqs, drafts, qs):
            r.spec_token_ids, r.draft_probs = d, q

    @property
    def needs_hidden(self) -> bool:
        """Whether `observe` wants the target's hidden states of every step (the MTP head and a Gemma 4 assistant
        read them)."""
        return self._hidden_reader is not None

    @property
    def _hidden_reader(self) -> MtpProposer | AssistantProposer | None:
        return self.mtp if self.mtp is not None else self.draft if isinstance(self.draft, AssistantProposer) else None

    def attach(self, pool, block_manager) -> None:
        """The engine's KV pool and BlockManager, for a proposer that reads the target's K/V (a Gemma 4 assistant)."""
        if isinstance(self.draft, AssistantProposer):
            self.draft.attach(pool, block_manager)

    def observe(self, scheduled: list[ScheduledSeq], hidden: torch.Tensor | None,
                requests: dict[str, "Request"]) -> None:
        """The target's hidden states [T, hidden] of a step (rows in `scheduled`'s order), for the MTP head or a
        Gemma 4 assistant."""
        reader = self._hidden_reader
        if reader is None or hidden is None:
            return
        wanted = {s.seq_id: requests[s.seq_id] for s in scheduled
                  if s.seq_id in requests and self.wants(requests[s.seq_id])}
        if self.backoff is not None and self.mtp is not None:
            # a paused request's head drops its rows and K/V and starts again when its pause ends: catching up
            # over the paused positions would cost what the pause saves (an MoE head reads the union of the
            # rows' experts), and its next probe needs only the positions from there on
            for seq_id in [i for i in wanted if self.backoff.paused(i)]:
                del wanted[seq_id]
                self.mtp.free(seq_id)
        reader.observe(scheduled, hidden, wanted)

    def verify(self, logits: torch.Tensor, scheduled: list[ScheduledSeq], rs: list["Request"]) -> list[list[int]]:
        """Accepted drafts plus the next token for each speculating request (see `_verify`)."""
        with intra_op_threads(self.threads):
            return self._verify(logits, scheduled, rs)

    def _verify(self, logits: torch.Tensor, scheduled: list[ScheduledSeq], rs: list["Request"]) -> list[list[int]]:
        """Accepted drafts plus the next token for each speculating request (read on the host); `logits` are its
        k+1 rows each, in order. The distributions are the plain sampler's (`verify.token_probs`), so the tokens
        are distributed exactly as without speculation."""
        drafts = [s.token_ids[-s.num_spec:] for s in scheduled]
        if all(r.params.greedy and not r.params.penalized and not r.params.logit_bias for r in rs):
            return self._count(rs, drafts, greedy_verify(logits, drafts))
        params = [r.params for r, d in zip(rs, drafts) for _ in range(len(d) + 1)]
        history = any(r.params.penalized for r in rs)
        prompt_ids = [r.prompt_token_ids for r, d in zip(rs, drafts) for _ in range(len(d) + 1)] if history else None
        output_ids = ([r.output_token_ids + d[:j] for r, d in zip(rs, drafts) for j in range(len(d) + 1)]
                      if history else None)
        p = token_probs(logits, params, prompt_ids, output_ids)
        q = None
        if self.draft is not None or self.mtp is not None:  # greedy drafts come without q: their point masses
            q = [r.draft_probs[: len(d)] if r.draft_probs.shape[0] >= len(d) else one_hot(d, p.shape[-1], p.device)
                 for r, d in zip(rs, drafts)]
        verdict = verify(p, drafts, q, [r.generator for r in rs], deterministic=all(r.params.greedy for r in rs))
        return self._count(rs, drafts, verdict)

    def _count(self, rs: list["Request"], drafts: list[list[int]], verdict: Verdict) -> list[list[int]]:
        """Each sequence's accepted drafts plus its next token, counted for /metrics (and the back-off)."""
        for r, d, a in zip(rs, drafts, verdict.num_accepted):
            self.counters.add(len(d), a)
            r.spec.add(len(d), a)
            if self.backoff is not None:
                self.backoff.record(r.request_id, len(d), a)
        return [d[:a] + [t] for d, a, t in zip(drafts, verdict.num_accepted, verdict.next_token)]

    def record_step(self, seqs: int, drafts: list[int], seconds: float) -> None:
        """A decode step of `seqs` sequences (one row each plus `drafts[i]` drafts for those that drafted) took
        `seconds`: a step where none drafted or each drafted `num_tokens` feeds the measured step costs, from which
        the back-off takes its break-even acceptance."""
        if drafts and (len(drafts) != seqs or any(d != self.num_tokens for d in drafts)):
            return  # a mixed step: neither cost
        self.costs.record(seqs, bool(drafts), seconds)
        if self.backoff is not None and (even := self.costs.break_even(seqs, self.num_tokens)) is not None:
            self.backoff.threshold = even

    def rollback(self, reqs: list["Request"]) -> None:
        """After `Scheduler.update`: drop the draft KV past each request's accepted tokens."""
        if self.draft is not None:
            for r in reqs:
                self.draft.rollback(r.request_id, r.num_computed_tokens)
        if self.mtp is not None:  # the target's hidden states of every token but the last are right (a hybrid's
            for r in reqs:        # accepted ones too, though its state went back to before them)
                self.mtp.rollback(r.request_id, r.num_tokens - 1)

    def free(self, request_id: str) -> None:
        """A request ended or was preempted: release its draft state."""
        if self.backoff is not None:
            self.backoff.forget(request_id)
        for proposer in filter(None, (self.draft, self.mtp)):
            proposer.free(request_id)
