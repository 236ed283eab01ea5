"""Speculative decoding: proposers (prompt lookup, draft model, a Gemma 4 assistant, the model's MTP head),
batched verification, KV rollback."""

from .assistant import AssistantProposer, is_assistant
from .draft import DraftMismatchError, DraftProposer, check_same_tokenizer, load_draft_model
from .mtp import MtpProposer, NoMtpHeadError
from .ngram import NgramProposer
from .speculator import SpecCounters, Speculator, speculative_method
from .verify import Verdict, token_probs, verify

__all__ = ["AssistantProposer", "DraftMismatchError", "DraftProposer", "MtpProposer", "NgramProposer",
           "NoMtpHeadError", "SpecCounters", "Speculator", "Verdict", "check_same_tokenizer", "is_assistant",
           "load_draft_model", "speculative_method", "token_probs", "verify"]
