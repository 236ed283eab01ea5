"""Where the served (bfloat16) path drifts from the float32 one: a converter-parity case (tests/converter_cases.py)
widened to `--hidden` (heads of `--head-dim`) with width-scaled weights as beside_llama_server.py makes them,
converted by llama.cpp's convert_hf_to_gguf.py (`--outtype`), loaded twice by edgeserve (dtype bfloat16 and
float32). Prints: the drift (mean |logprob diff| over float32's top 5) over random prompts, with each run's own
expert choices and with the float32 run's forced on the bfloat16 one; per MoE layer, the share of expert choices
that differ; the drift of the model cut after each layer. The per-op path (MoE layers on their torch path, where
the router is called in Python), and the fused native stack where the model uses it.

    .venv/bin/python benchmarks/quality/layer_drift.py --case gemma4-26b-a4b --hidden 256 --head-dim 256 \\
        --work /tmp/drift
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from converter_cases import BY_NAME  # noqa: E402
from converter_parity import (IDS, build_checkpoint, convert, load_ours, our_logits,  # noqa: E402
                              spm_tokenizer_folder, tokenizer_folder)

LOGIT_SCALE = 2.5  # as beside_llama_server.py: logits with a standard deviation of a few units


def widened(name: str, hidden: int, head_dim: int | None = None):
    """Case `name` at `hidden` width (heads kept; with `head_dim`, heads of that size, a Gemma 4 global head twice
    it), its matrices scaled by sqrt(64 / hidden) as beside_llama_server."""
    base = BY_NAME[name]

    def config(vocab: int):
        cfg = base.config(vocab)
        values = {k: v for k, v in cfg.to_dict().items() if k != "per_layer_config"}
        ratio = hidden // values["hidden_size"]
        for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
            if values.get(key):
                values[key] = values[key] * ratio
        if head_dim:
            values["head_dim"] = head_dim
            if values.get("global_head_dim"):
                values["global_head_dim"] = 2 * head_dim
        return type(cfg)(**values)

    def init(model) -> None:
        from converter_parity import spread

        (base.init or spread)(model)
        scale = (64 / hidden) ** 0.5
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.mul_(scale)
            model.get_output_embeddings().weight.mul_(LOGIT_SCALE)

    return replace(base, name=f"{name}-{hidden}-{head_dim or 0}", config=config, init=init)


def make_gguf(name: str, hidden: int, work: Path, head_dim: int | None = None, outtype: str = "f32") -> Path:
    """The case's GGUF of `outtype` (f32, bf16, q8_0: the converter's; made once under `work`)."""
    case = widened(name, hidden, head_dim)
    out = work / f"{case.name}.{outtype}.gguf"
    if out.exists():
        return out
    tok = work / f"tok-{case.tokenizer}"
    if not tok.exists():
        if case.tokenizer == "spm":
            spm_tokenizer_folder(tok)
        else:
            from edgeserve.registry import DEFAULT_MODEL, pull

            tokenizer_folder(pull(DEFAULT_MODEL, progress=False), tok)
    folder = work / case.name
    if not (folder / "config.json").exists():
        build_checkpoint(case, tok, folder)
    return convert(folder, out, *case.convert_args, outtype=outtype)


def top5_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean |log-probability difference| over `ref`'s top 5 at every position."""
    top = ref.topk(5, dim=-1).indices
    return (ours.gather(1, top) - ref.gather(1, top)).abs().mean().item()


def layer_outputs(model, native: bool) -> list[torch.Tensor]:
    """The log-probabilities of `model` cut after each layer in turn (1..L: the final norm and output head on that
    layer's residual stream), at every position of IDS."""
    layers = model.layers
    outs = []
    try:
        for n in range(1, len(layers) + 1):
            model.layers = layers[:n]
            model._native = False if native else None
            outs.append(our_logits(model).log_softmax(-1))
    finally:
        model.layers = layers
        model._native = False if native else None
    return outs


def routing(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(weights, expert ids) each MoE layer's router gives on IDS (two prompt chunks, then decodes), in call order
    (the per-op path: MoELayer.route, which Gemma 4 calls itself and the other MoE models through
    MoELayer.forward)."""
    from edgeserve.models.moe import MoELayer

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    orig = MoELayer.route

    def recording(self, h):
        out = orig(self, h)
        seen.append(out)
        return out

    MoELayer.route = recording
    native = model._native
    try:
        model._native = None
        for layer in model.layers:
            if _moe_of(layer) is not None:
                _moe_of(layer)._native = None
        our_logits(model)
    finally:
        MoELayer.route = orig
        model._native = native
    return seen


def routing_drift(bf, f32) -> None:
    """Per MoE layer, over IDS's steps: the share of (token, expert) choices that differ between the dtypes, and the
    largest float32 router weight of an expert the bfloat16 model did not choose (what a flip moves)."""
    calls = list(zip(routing(bf), routing(f32)))
    layers = sum(1 for layer in bf.layers if _moe_of(layer) is not None)
    for i in range(layers):
        differ = total = 0
        lost = 0.0
        for (wb, eb), (wf, ef) in calls[i::layers]:
            for row_w, row_e, other in zip(wf.tolist(), ef.tolist(), eb.tolist()):
                dropped = [w for w, e in zip(row_w, row_e) if e not in other]
                differ, total = differ + len(dropped), total + len(row_e)
                lost = max([lost, *dropped])
        print(f"  MoE layer {i}: {differ / total:.1%} of {total} expert choices differ; largest float32 weight of "
              f"an expert bfloat16 dropped: {lost:.3f}")


def _moe_of(layer):
    """The layer's MoELayer, or None."""
    from edgeserve.models.moe import MoELayer

    for name in ("moe", "mlp", "ffn"):
        if isinstance(getattr(layer, name, None), MoELayer):
            return getattr(layer, name)
    return None


def prompt_drift(bf, f32, prompts: list[list[int]], forced: bool) -> list[float]:
    """Per prompt: mean |logprob diff| of the bfloat16 model from the float32 one over the latter's top 5, at every
    position (per-op path); `forced`: the bfloat16 model given the float32 model's expert choices and weights."""
    from edgeserve.models.moe import MoELayer

    orig, out = MoELayer.route, []
    for m in (bf, f32):
        m._native = None
        for layer in m.layers:
            if _moe_of(layer) is not None:
                _moe_of(layer)._native = None  # the torch path around the expert matmuls: it calls route
    for p in prompts:
        seen: list = []
        MoELayer.route = lambda self, h: seen.append(orig(self, h)) or seen[-1]
        try:
            ref = our_logits(f32, p, prompt_len=len(p)).log_softmax(-1)
            replay = iter(seen)
            MoELayer.route = (lambda self, h: next(replay)) if forced else orig
            lb = our_logits(bf, p, prompt_len=len(p)).log_softmax(-1)
        finally:
            MoELayer.route = orig
        top = ref.topk(5, dim=-1).indices
        out.append((lb.gather(1, top) - ref.gather(1, top)).abs().mean().item())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="gemma4-26b-a4b")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=0)
    ap.add_argument("--outtype", default="f32", choices=("f32", "bf16", "q8_0"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--work", type=Path, default=Path("/tmp/layer_drift"))
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    gguf = make_gguf(a.case, a.hidden, a.work, a.head_dim, a.outtype)
    bf, f32 = (load_ours(gguf, dtype=d).model for d in ("bfloat16", "float32"))
    g = torch.Generator().manual_seed(54)
    prompts = [torch.randint(3, 30000, (24,), generator=g).tolist() for _ in range(a.prompts)]
    for forced in (False, True):
        d = prompt_drift(bf, f32, prompts, forced)
        print(f"per-op, {a.prompts} prompts of 24 tokens, mean |logprob diff| over the float32 top 5 at every position"
              f"{', the float32 expert choices forced' if forced else ''}: mean {sum(d) / len(d):.4f} "
              f"(per prompt {' '.join(f'{x:.3f}' for x in d)})")
    print("routing on IDS, bfloat16 against float32 (per-op path):")
    routing_drift(bf, f32)
    for native in (False, True):
        path = "fused native" if native else "per-op"
        for m in (bf, f32):
            m._native = False if native else None
        if native and (bf.native_decoder() is None):
            print(f"{path}: not used by this model")
            continue
        ob, of = layer_outputs(bf, native), layer_outputs(f32, native)
        print(f"{path}: mean |logprob diff| over the float32 top 5 of the model cut after layer 1..{len(ob)}:",
              " ".join(f"{top5_diff(x, y):.4f}" for x, y in zip(ob, of)))
        lb, lf = (our_logits(m).log_softmax(-1) for m in (bf, f32))
        top = lf.topk(5, dim=-1).indices
        print(f"{path}: mean |logprob diff| over the float32 top 5: "
              f"{(lb.gather(1, top) - lf.gather(1, top)).abs().mean().item():.4f}, max over the vocabulary "
              f"{(lb - lf).abs().max().item():.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
