"""Qwen3.5 on a CUDA GPU (skipped without one): the model against transformers in float32 on the GPU's kernels
(Triton RoPE + K/V write and paged attention, the torch twins of the Gated DeltaNet), dense and MoE; the engine on
the GPU (overlap on, the pool sized by a warm-up step with a recurrent state): greedy outputs the same batched or
alone, and a second turn that hits the prefix cache the same as a cold run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from edgeserve.engine.config import EngineConfig
from edgeserve.engine.core import EngineCore
from edgeserve.llm import LLM
from edgeserve.loaders.hf_folder import HFFolder
from edgeserve.models.config import config_from_hf
from edgeserve.models.dummy import dummy_chat_template, dummy_tokenizer
from edgeserve.models.load import LoadedModel
from edgeserve.models.qwen35 import Qwen35Model
from edgeserve.registry.resolve import ModelSource
from edgeserve.sampling_params import SamplingParams

from qwen35_helpers import DECODES, PROMPT, VOCAB, hf_qwen35, reference_logits, run_steps

pytest.importorskip("transformers")

IDS = PROMPT + list(range(40, 40 + DECODES))
STEPS = [[(0, 7)], [(7, len(PROMPT))]] + [[(p, p + 1)] for p in range(len(PROMPT), len(IDS))]


def load(model, folder: Path, dtype: torch.dtype, device: torch.device) -> Qwen35Model:
    model.save_pretrained(folder)
    config = config_from_hf(json.loads((folder / "config.json").read_text()))
    return Qwen35Model.from_weights(config, HFFolder(folder).weights(), dtype=dtype, device=device)


def logits_match(moe: bool, tmp_path: Path, device: torch.device) -> None:
    model = hf_qwen35(moe)
    ours = run_steps(load(model, tmp_path / "hf", torch.float32, device), STEPS, [IDS])[0].float().cpu()
    assert (ours - reference_logits(model, IDS)).abs().max().item() < 2e-3


def engine_outputs(tmp_path: Path, device: torch.device) -> None:
    m = load(hf_qwen35(), tmp_path / "hf", torch.float32, device)
    lm = LoadedModel("q35", ModelSource("q35", "hf", tmp_path / "hf"), m.config, m,
                     dummy_tokenizer(m.config.vocab_size), dummy_chat_template(), 0.0)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 23, 40, 71)]
    cold = LLM.from_model(lm, kv_cache_gb=0.05, enable_prefix_caching=False)
    together = [r.outputs[0].token_ids for r in cold.generate(prompts, greedy)]
    assert together == [cold.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]
    warm = LLM.from_model(lm, kv_cache_gb=0.05)
    first = prompts[2] + [7, 8, 9]
    second = first + warm.generate([first], greedy)[0].outputs[0].token_ids + [20, 21, 22, 23]
    before = warm.engine.stats().prompt_tokens_reused
    hit = warm.generate([second], greedy)[0].outputs[0].token_ids
    assert warm.engine.stats().prompt_tokens_reused - before == 48
    assert hit == cold.generate([second], greedy)[0].outputs[0].token_ids
    assert warm.engine.states.num_seated == 0
    if device.type == "cuda":  # the pool sized by a warm-up step, which runs the state too
        sized = EngineCore(lm, EngineConfig(gpu_memory_fraction=0.5))
        assert sized.states.budget.seats == sized.config.max_num_seqs


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_logits_match_transformers_on_the_gpu(moe: bool, tmp_path: Path) -> None:
    logits_match(moe, tmp_path, torch.device("cuda"))


@cuda
def test_engine_on_the_gpu(tmp_path: Path) -> None:
    engine_outputs(tmp_path, torch.device("cuda"))
