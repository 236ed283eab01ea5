"""`LLM`: the Python API for embedding edgeserve (batched offline generation and chat on one engine)."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from edgeserve.engine.config import EngineConfig
from edgeserve.engine.core import EngineCore
from edgeserve.engine.delivery import Outbox, step_and_deliver
from edgeserve.engine.spec import load_draft_model
from edgeserve.engine.outputs import RequestOutput, TokenLogprob
from edgeserve.models.load import LoadedModel, load_model
from edgeserve.models.load_config import LoadConfig
from edgeserve.registry import DEFAULT_MODEL, resolve
from edgeserve.sampling_params import SamplingParams
from edgeserve.text.chat_prompt import chat_ids

Messages = list[dict]


@dataclass
class CompletionOutput:
    """One generated completion."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class GenerationResult:
    """A prompt and what was generated for it (`outputs[0]`; `.text` for short)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0

    @property
    def text(self) -> str:
        return self.outputs[0].text


class LLM:
    """A model and its engine: `LLM("smollm2-135m").generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str = DEFAULT_MODEL, *, dtype: str = "auto", device: str = "auto",
                 load_format: str = "auto", dense_prefill: str = "auto", config: EngineConfig | None = None,
                 quantize: str | None = None, quantize_group_size: int = 128, quantize_calibration: str | None = None,
                 cpu_moe_layers: int | str | None = None, mmproj: str | None = None, load: LoadConfig | None = None,
                 **engine_options) -> None:
        """Load `model` (catalog name, .gguf file or Hugging Face folder) and build its engine.

        `device`: auto (CUDA when available, else CPU), cpu, cuda, cuda:N; `dtype`: auto (follows the file:
        `edgeserve.models.dtype_policy`; bfloat16, float16 on sm_75, for BF16 and quantized files), float32,
        bfloat16, float16; `load_format="dummy"`: random weights of a config.json's shape.
        `quantize="int4"` quantizes a float model to INT4 at load (see `load_model`). `dense_prefill`: auto / on /
        off (`edgeserve.models.load.want_dense_prefill`). `cpu_moe_layers` (a count or "all"): the experts of the
        first that many MoE layers stay in host memory on the CPU kernels (`edgeserve.models.cpu_moe`).
        `mmproj`: a vision projector GGUF for a GGUF model (an HF folder's vision tower, or an mmproj beside the GGUF,
        is found without it); `image_prompt` then builds prompts with images. `load`: all the load options at once
        (a LoadConfig), instead of the keywords above.
        `engine_options` are EngineConfig fields (max_num_seqs, max_num_batched_tokens, kv_cache_gb, kv_cache_dtype,
        gpu_memory_fraction, enforce_eager, ...).
        """
        if config is not None and engine_options:
            raise ValueError("pass either config or engine options, not both")
        self.config = config or EngineConfig(**engine_options)
        source = resolve(model)
        load = load or LoadConfig(dtype=dtype, device=device, load_format=load_format, quantize=quantize,
                                  quantize_group_size=quantize_group_size, quantize_calibration=quantize_calibration,
                                  dense_prefill=dense_prefill, cpu_moe_layers=cpu_moe_layers)
        self.lm: LoadedModel = load_model(source, load)
        if load.load_format != "dummy":
            from edgeserve.vision.runtime import load_runtime

            self.lm.vision = load_runtime(source, self.lm, mmproj)
        self.engine = EngineCore(self.lm, self.config, draft=load_draft_model(self.config.draft_model, self.lm))

    @classmethod
    def from_model(cls, lm: LoadedModel, config: EngineConfig | None = None, *, draft: LoadedModel | None = None,
                   **engine_options) -> "LLM":
        """An LLM over a model already loaded (`load_model`), with its own engine; `draft`: a loaded draft model
        for `speculative="draft"`."""
        self = cls.__new__(cls)
        self.config = config or EngineConfig(**engine_options)
        self.lm = lm
        self.engine = EngineCore(lm, self.config, draft=draft or load_draft_model(self.config.draft_model, lm))
        return self

    def close(self) -> None:
        """Persist what the KV offload tiers should keep (a no-op with offload off); call before exiting."""
        self.engine.close()

    @property
    def tokenizer(self):
        return self.lm.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[GenerationResult]:
        """Complete each prompt (text, or token ids), all batched together; results come in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        items = [(p, self.lm.tokenizer.encode(p)) if isinstance(p, str) else (None, list(p)) for p in prompts]
        return self._run(items, sampling_params)

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[GenerationResult]:
        """Reply to one conversation or several, through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        items = [(None, chat_ids(self.lm.tokenizer, self.lm.chat_template, list(conv))) for conv in conversations]
        return self._run(items, sampling_params)

    def image_prompt(self, text: str, images: list, system: str | None = None) -> tuple[list[int], dict]:
        """A user turn of `text` after the Pillow `images` (after a `system` message), through the chat template:
        its token ids and the `images` / `prefix_key` (/ `mrope`, `attend_spans`) that `stream` passes on (a
        ValueError for a model without vision)."""
        from edgeserve.vision.prompt import image_mark, image_prompt

        vision = self.lm.vision
        if vision is None:
            raise ValueError(f"{self.lm.name} does not take images (no vision projector; give one with --mmproj)")
        content = "".join(image_mark(i) for i in range(len(images))) + text
        turns = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
        rendered = self.lm.chat_template.render(turns, add_generation_prompt=True)
        placed = image_prompt(rendered, dict(enumerate(images)), vision.family, self.lm.tokenizer, vision.key)
        embeds, _ = vision.embeddings([p.prepared for p in placed.images], [p.key for p in placed.images])
        return placed.ids, placed.engine_request(vision.family, embeds)

    def stream(self, prompt_ids: list[int], params: SamplingParams | None = None, adapter: str | None = None,
               **request: Any) -> Iterator[RequestOutput]:
        """Deltas of one completion as they are generated (what `edgeserve run` prints); `adapter`: the name of a
        LoRA adapter of the config's `loras` to run it with; `request`: prefix_key, images, mrope and attend_spans,
        as `image_prompt` gives them."""
        params = params or SamplingParams()
        rid = self.engine.add_request(prompt_ids, params, adapter=adapter, **request)
        outbox, deltas = Outbox(), []
        outbox.open(rid, deltas.append)
        try:
            while rid in outbox or deltas:
                if not deltas:
                    step_and_deliver(self.engine, outbox)
                item = deltas.pop(0) if deltas else None
                if isinstance(item, Exception):
                    raise item
                if item is not None:
                    yield item
        finally:
            if rid in outbox:
                self.engine.finish_request(rid, "abort")
            while self.engine.has_work():  # finish the abort so the pool is clean for the next call
                self.engine.step()

    def _run(self, items: list[tuple[str | None, list[int]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> list[GenerationResult]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"{len(params)} sampling params for {len(items)} prompts")
        outbox = Outbox()
        results = []
        for (prompt, ids), p in zip(items, params):
            # the queue bound is for servers; an offline batch is fed as room frees up
            while self.engine.num_unfinished >= self.config.max_waiting:
                step_and_deliver(self.engine, outbox)
            rid = self.engine.add_request(ids, p)
            result = GenerationResult(rid, prompt, ids, [CompletionOutput("", [], None, logprobs=None)])
            outbox.open(rid, functools.partial(_accumulate, result))
            results.append(result)
        while self.engine.has_work():
            step_and_deliver(self.engine, outbox)
        return results


def _accumulate(result: GenerationResult, delta: RequestOutput | Exception) -> None:
    """Add one delta to a result."""
    if isinstance(delta, Exception):
        raise delta
    c = result.outputs[0]
    c.text += delta.text
    c.token_ids.extend(delta.token_ids)
    if delta.logprobs is not None:
        c.logprobs = (c.logprobs or []) + delta.logprobs
    result.num_cached_tokens = delta.num_cached_tokens
    if delta.finished:
        c.finish_reason, c.stop_reason = delta.finish_reason, delta.stop_reason
