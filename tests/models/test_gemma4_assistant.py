"""Gemma 4 assistant drafters (issue 50): a tiny random Gemma 4 target (the gemma4-e2b case: shared-KV layers,
per-layer inputs, sliding and global layers) and a matching assistant made in transformers, both converted by
llama.cpp's own convert_hf_to_gguf.py (`gemma4-assistant`).

- the assistant's logits (GGUF and HF folder) over our target's K/V equal transformers' Gemma4AssistantForCausalLM
  fed the target's shared_kv_states, for a chain of drafts at one position, past the sliding window;
- inside the engine, each first and second draft is that reference's argmax for the sequence so far (through
  prompt chunks, accepted, partly accepted and rejected drafts; an oracle forces acceptance, since a random
  assistant never agrees with a random target);
- greedy output with the assistant on equals off token for token, alone and in a mixed batch, per-op (the f32
  E2B-like target) and with the target on the fused native stack (the gemma4-12b case's Q8_0: a `gemma4_unified`
  target, which the same assistant fits); `--speculative auto` picks it for `--draft`;
- at temperature > 0 its drafts carry their distributions to rejection sampling;
- an assistant whose target does not match (architecture, vocabulary, hidden size, heads) is refused in one line.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from converter_cases import BY_NAME  # noqa: E402
from converter_parity import build_checkpoint, convert, load_ours, max_logprob_diff, spm_tokenizer_folder  # noqa: E402
from support.spec_runs import (ForcedOracle, assert_drafts_are_reference_argmax,  # noqa: E402
                               assert_drafts_carry_distributions, assert_mixed_batch_keeps_greedy, outputs, prompts)

from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention  # noqa: E402
from edgeserve.engine.spec import AssistantProposer, DraftMismatchError  # noqa: E402
from edgeserve.engine.spec.assistant import TargetKV  # noqa: E402
from edgeserve.kernels.dispatch import AttentionMetadata  # noqa: E402
from edgeserve.llm import LLM  # noqa: E402
from edgeserve.models.archs.gemma4_assistant.model import target_layers, target_mismatch  # noqa: E402

F32_BOUND = 2e-4  # float32 noise, as in test_registered_architectures
PROMPT = [1, 504, 3458, 314, 253, 1837, 28, 2, 1010, 17, 31000, 5, 800, 12000, 31, 7]  # longer than the window (5)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return spm_tokenizer_folder(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def files(tokenizer, tmp_path_factory):
    """(target HF, target folder, target f32 GGUF, assistant HF, assistant folder, assistant f32 GGUF), made once a
    module; the target is the gemma4-e2b case."""
    made = []
    for name in ("gemma4-e2b", "gemma4-assistant"):
        folder = tmp_path_factory.mktemp(name)
        made += [build_checkpoint(BY_NAME[name], tokenizer, folder), folder,
                 convert(folder, folder.parent / f"{name}.f32.gguf")]
    return tuple(made)


@pytest.fixture(scope="module")
def fused_target(tokenizer, tmp_path_factory) -> Path:
    """The gemma4-12b case as Q8_0 (its target runs on the fused native stack; the E2B-like case's per-layer inputs
    of width 8 keep it per-op)."""
    folder = tmp_path_factory.mktemp("gemma4-12b")
    build_checkpoint(BY_NAME["gemma4-12b"], tokenizer, folder)
    return convert(folder, folder.parent / "gemma4-12b.q8.gguf", outtype="q8_0")


def reference_drafts(target, assistant, tokens: list[int], drafts: list[int]) -> torch.Tensor:
    """transformers' assistant logits [len(drafts) + 1, V] for a sequence `tokens` whose last token the target has
    not computed: the target's shared_kv_states over tokens[:-1] (the sliding ones cut to the last window - 1, as
    the draft's position sees them: llama.cpp's mask) and its last hidden state, then one row per draft at the last
    token's position (`drafts`: the tokens fed after the first row)."""
    with torch.no_grad():
        out = target(input_ids=torch.tensor([tokens[:-1]]), output_hidden_states=True, return_shared_kv_states=True,
                     use_cache=False)
        window = target.config.sliding_window
        kv = {kind: (k[:, :, -(window - 1):], v[:, :, -(window - 1):]) if kind == "sliding_attention" else (k, v)
              for kind, (k, v) in out.shared_kv_states.items()}
        h, rows = out.hidden_states[-1][:, -1:], []
        position = torch.tensor([[len(tokens) - 1]])
        for t in [tokens[-1], *drafts]:
            embeds = torch.cat([target.model.embed_tokens(torch.tensor([[t]])), h], dim=-1)
            a = assistant(inputs_embeds=embeds, position_ids=position, shared_kv_states=kv)
            rows.append(a.logits[0, -1].float())
            h = a.last_hidden_state
    return torch.stack(rows)


def our_drafts(target, assistant, tokens: list[int], drafts: list[int]) -> torch.Tensor:
    """Our assistant's logits for the same rows, over our target's paged K/V of tokens[:-1] (in two chunks)."""
    n, block = len(tokens), 4
    blocks = -(-n // block)
    pool, table = KVPool(target.config, blocks, block, target.dtype), list(range(blocks))
    with torch.no_grad():
        for a, b in ((0, 7), (7, n - 1)):
            meta = AttentionMetadata.build([b - a], [b], [table], list(range(a, b)))
            hidden = target.forward(torch.tensor(tokens[a:b]), torch.arange(a, b), PagedKVAttention(pool, meta))
        sources = target_layers(target.config)
        view = TargetKV(PagedKVAttention(pool, AttentionMetadata.build([1], [n - 1], [table], [n - 2])),
                        [sources[assistant.config.is_global(i)] for i in range(assistant.config.num_layers)])
        h, rows = hidden[-1:], []
        for t in [tokens[-1], *drafts]:
            embeds = target.embed_rows(torch.tensor([t])) * target.embed_scale
            logits, h = assistant.draft(embeds, h, torch.tensor([n - 1]), view)
            rows.append(logits[0])
    return torch.stack(rows)


def test_assistant_logits_equal_transformers(files):
    t_hf, _, t_gguf, a_hf, a_folder, a_gguf = files
    drafts = [9000, 40]
    ref = reference_drafts(t_hf, a_hf, PROMPT, drafts)
    assert ref.abs().max() > 1.0 and len(PROMPT) - 1 > t_hf.config.sliding_window
    target = load_ours(t_gguf).model
    for path in (a_gguf, a_folder):
        lm = load_ours(path)
        assert lm.config.architecture == "gemma4-assistant" and lm.config.backbone_hidden_size == 64
        diff = max_logprob_diff(our_drafts(target, lm.model, PROMPT, drafts), ref)
        print(f"{path.name}: max |logprob diff| {diff:.2e}")
        assert diff < F32_BOUND, path


def test_centroid_masked_head_equals_transformers(files, tokenizer, tmp_path):
    """An assistant with `use_ordered_embeddings` (the E2B / E4B checkpoints' head over the top centroids' tokens),
    from its HF folder: the same logits as transformers', masked entries included; a GGUF (its converter drops the
    centroids) keeps the whole head."""
    import shutil

    import transformers

    from converter_cases import GEMMA4, GEMMA4_ASSISTANT, gemma4_init

    t_hf, _, t_gguf, _, _, _ = files
    vocab = t_hf.config.vocab_size
    cfg = transformers.Gemma4AssistantConfig(text_config=dict(GEMMA4_ASSISTANT, vocab_size=vocab),
                                             backbone_hidden_size=GEMMA4["hidden_size"], use_ordered_embeddings=True,
                                             num_centroids=64, centroid_intermediate_top_k=4)
    cfg._attn_implementation = "eager"
    torch.manual_seed(1)
    hf = transformers.Gemma4AssistantForCausalLM(cfg).float().eval()
    gemma4_init(hf)
    with torch.no_grad():
        hf.masked_embedding.token_ordering.copy_(torch.randperm(vocab))
    hf.save_pretrained(tmp_path)
    for f in tokenizer.iterdir():
        shutil.copy(f, tmp_path / f.name)
    drafts = [9000, 40]
    ref = reference_drafts(t_hf, hf, PROMPT, drafts)
    masked = ref == ref.min(dim=-1, keepdim=True).values
    assert (masked.sum(-1) == vocab - 4 * vocab // 64).all()  # all but the top 4 centroids' 500 tokens
    lm = load_ours(tmp_path)
    assert lm.config.head_top_centroids == 4 and lm.model.centroids is not None
    ours = our_drafts(load_ours(t_gguf).model, lm.model, PROMPT, drafts)
    assert max_logprob_diff(ours, ref) < F32_BOUND
    gguf = load_ours(convert(tmp_path, tmp_path.parent / "ordered-assistant.f32.gguf"))
    assert gguf.config.head_top_centroids == 0 and gguf.model.centroids is None


def engines(target_path: Path, assistant_path: Path, dtype: str = "float32", **options) -> tuple[LLM, LLM]:
    """(plain, with the assistant through --speculative auto) over one loaded target."""
    lm = load_ours(target_path, dtype=dtype)
    plain = LLM.from_model(lm, kv_cache_gb=0.01, speculative="off")
    spec = LLM.from_model(lm, kv_cache_gb=0.01, draft_model=str(assistant_path), draft=load_ours(assistant_path),
                          **options)
    assert spec.engine.spec.method == "draft" and isinstance(spec.engine.spec.draft, AssistantProposer)
    assert spec.engine.spec.num_tokens == options.get("num_speculative_tokens", 1)  # the measured default: 1
    return plain, spec


def test_engine_drafts_are_the_reference_assistants(files):
    """Each first and second draft is the argmax of the reference assistant for the sequence so far."""
    t_hf, _, t_gguf, a_hf, _, a_gguf = files
    ps = prompts(1, 2)
    plain, spec = engines(t_gguf, a_gguf, num_speculative_tokens=3, max_num_batched_tokens=16, block_size=4)
    ref_out = outputs(plain, ps)
    oracle = spec.engine.spec.draft.oracle = ForcedOracle(ps, ref_out, t_hf.config.vocab_size)
    assert outputs(spec, ps) == ref_out
    c = spec.engine.spec.counters
    assert 0 < c.accepted < c.proposed  # drafts accepted and rejected
    assert_drafts_are_reference_argmax(oracle.seen[::2], lambda tokens, drafts: reference_drafts(t_hf, a_hf, tokens,
                                                                                                  drafts[:1]))


@pytest.mark.parametrize("weights", ["f32", "q8"])
def test_greedy_with_the_assistant_is_greedy_without(weights, files, request):
    """Alone and in a mixed batch (a sampled request and one that opts out beside greedy ones), the target per-op
    (f32) and on the fused native stack (Q8_0), with the assistant's own drafts and with forced acceptance."""
    _, _, f32, _, _, a_gguf = files
    target = f32 if weights == "f32" else request.getfixturevalue("fused_target")
    plain, spec = engines(target, a_gguf, "float32" if weights == "f32" else "bfloat16")
    assert (spec.lm.model.native_decoder() is not None) == (weights == "q8")
    ps = prompts(2)
    ref = outputs(plain, ps)
    assert [outputs(spec, [p])[0] for p in ps] == ref
    assert spec.engine.spec.counters.proposed > 0
    assert_mixed_batch_keeps_greedy(spec, spec.engine.spec.draft, ps, ref)
    assert not spec.engine.spec.draft.rows  # every request's rows forgotten when it ended
    spec.engine.scheduler.block_manager.check_integrity()


def test_temperature_drafts_carry_their_distributions_to_verification(files, monkeypatch):
    _, _, t_gguf, _, _, a_gguf = files
    assert_drafts_carry_distributions(monkeypatch, engines(t_gguf, a_gguf)[1])


def test_a_mismatched_target_is_refused_in_one_line(files, default_model_path, capsys):
    from edgeserve.cli import main

    _, _, t_gguf, _, _, a_gguf = files
    target, assistant = load_ours(t_gguf), load_ours(a_gguf)
    t, a = target.config, assistant.config
    assert target_mismatch(a, t) is None
    for other, words in ((dataclasses.replace(t, vocab_size=t.vocab_size + 1), "vocabulary"),
                         (dataclasses.replace(t, hidden_size=96), "hidden size 64, this one has 96"),
                         (dataclasses.replace(t, architecture="gemma3"), "Gemma 4 models only"),
                         (dataclasses.replace(t, global_head_dim=64), "cannot read the target's K/V")):
        assert words in target_mismatch(a, other)
    with pytest.raises(DraftMismatchError, match="Gemma 4 models only"):
        LLM.from_model(load_ours(default_model_path), kv_cache_gb=0.01, draft_model=str(a_gguf), draft=assistant)
    argv = ["run", str(default_model_path), "hi", "--draft", str(a_gguf), "--max-tokens", "2"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Gemma 4 models only" in err[0] and "Traceback" not in err[0]
    # the matching target runs with it from the command line
    assert main(["run", str(t_gguf), "hi", "--draft", str(a_gguf), "--max-tokens", "3", "--temperature", "0"]) == 0
    capsys.readouterr()
    # the assistant alone is no model to serve
    assert main(["run", str(a_gguf), "hi", "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Gemma 4 assistant" in err[0]
