"""Turns one request's token outputs into text deltas: incremental detokenization and stop strings."""

from __future__ import annotations

from edgeserve.loaders.tokenizer import Tokenizer
from edgeserve.sampling_params import SamplingParams
from edgeserve.text.detokenizer import IncrementalDetokenizer
from edgeserve.text.stop import StopMatcher

from ..outputs import RequestOutput, TokenOutput


class OutputProcessor:
    """Per request: token ids in, final text out (nothing shown is ever retracted)."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, tokenizer: Tokenizer) -> None:
        self.request_id = request_id
        self._detok = IncrementalDetokenizer(tokenizer.decode, prompt_ids, tokenizer.byte_fallback_ids)
        self._stop = StopMatcher(params.stop) if params.stop else None
        self.done = False

    @property
    def stopped_by_string(self) -> bool:
        """A stop string matched: the engine must end the request (reason 'stop')."""
        return self._stop is not None and self._stop.stopped

    def process(self, out: TokenOutput) -> RequestOutput | None:
        """The delta for one step's output, or None if the request already ended here (stop string)."""
        if self.done:
            return None
        finishing = out.finish_reason is not None
        # an end-of-turn / stop token ends the text; its own text is never shown
        text_ids = out.token_ids[:-1] if out.stop_reason is not None else out.token_ids
        token_ids, logprobs = list(out.token_ids), out.logprobs
        finish, stop_reason = out.finish_reason, out.stop_reason
        if self._stop is not None and len(text_ids) > 1:
            # several tokens at once (speculative decoding): feed them one by one, so the delta ends with the
            # token that completes a stop string, exactly as token-by-token decoding would have ended it
            text, stopped = "", False
            for i, t in enumerate(text_ids):
                piece, stopped = self._stop.push(self._detok.push([t]))
                text += piece
                if stopped:
                    token_ids, logprobs = token_ids[: i + 1], (logprobs[: i + 1] if logprobs is not None else None)
                    finish, stop_reason = "stop", self._stop.matched
                    break
            if not stopped and finishing:
                piece, stopped = self._stop.push(self._detok.flush())
                text += piece
                if stopped:
                    finish, stop_reason = "stop", self._stop.matched
                else:
                    text += self._stop.flush()
        else:
            text = self._detok.push(text_ids) if text_ids else ""
            if finishing:
                text += self._detok.flush()
            if self._stop is not None:
                text, stopped = self._stop.push(text)
                if stopped:
                    finish, stop_reason = "stop", self._stop.matched
                elif finishing:
                    text += self._stop.flush()
        self.done = finish is not None
        return RequestOutput(
            request_id=out.request_id,
            text=text,
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=finish,
            stop_reason=stop_reason,
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            # tokens of a speculative run past the stop string were never shown: they are not output either
            num_output_tokens=out.num_output_tokens - (len(out.token_ids) - len(token_ids)),
            spec=out.spec,
        )
