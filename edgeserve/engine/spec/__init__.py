"""Speculative decoding: proposers (prompt lookup, draft model, the model's MTP head), batched verification, KV
rollback."""

from .draft import DraftMismatchError, DraftProposer, check_same_tokenizer, load_draft_model
from .mtp import MtpProposer, NoMtpHeadError
from .ngram import NgramProposer
from .speculator import SpecCounters, Speculator, speculative_method
from .verify import Verdict, token_probs, verify

__all__ = ["DraftMismatchError", "DraftProposer", "MtpProposer", "NgramProposer", "NoMtpHeadError", "SpecCounters",
           "Speculator", "Verdict", "check_same_tokenizer", "load_draft_model", "speculative_method", "token_probs",
           "verify"]
