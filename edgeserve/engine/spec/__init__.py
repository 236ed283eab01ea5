"""Speculative decoding: proposers (prompt lookup, draft model), batched verification, KV rollback."""

from .draft import DraftMismatchError, DraftProposer, check_same_tokenizer, load_draft_model
from .ngram import NgramProposer
from .speculator import SpecCounters, Speculator
from .verify import Verdict, token_probs, verify

__all__ = ["DraftMismatchError", "DraftProposer", "NgramProposer", "SpecCounters", "Speculator", "Verdict",
           "check_same_tokenizer", "load_draft_model", "token_probs", "verify"]
