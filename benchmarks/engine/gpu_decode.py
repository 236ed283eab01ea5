"""Decode speed on a CUDA GPU, read against the memory-bandwidth roofline (first run: docs/perf-log/2026-11-to-12.md, H100).

1. Batch-1 decode of a dummy Llama-3-8B (benchmarks/configs/llama-3-8b.json: random weights drawn on the GPU,
   no download) in bf16 and in int4 (llama-3-8b-int4.json: 4-bit W4A16, group 128), with and without CUDA graphs
   and with and without the one-step overlap (--overlap):
   tokens/s, and achieved GB/s = bytes read per token (weights as stored + the KV of the context) / time per
   token, as a % of the device's peak bandwidth (a table by device name; `--bandwidth-gbs` overrides).
2. Aggregate output tokens/s at 1, 8, 32 and 64 concurrent requests (512 prompt / 128 output tokens) through the
   engine (continuous batching, graphs on), next to transformers' `generate()` on the same device and shape
   (random weights, static batch, `--skip-transformers` to leave it out).
3. Single-stream decode tokens/s of the default model (smollm2-135m, when it is pulled).

    python benchmarks/engine/gpu_decode.py [--models bf16,int4] [--concurrency 1,8,32,64] [--bandwidth-gbs 3350]

On a machine without CUDA it prints one line and exits with status 1.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MODELS = {"bf16": CONFIGS / "llama-3-8b.json", "int4": CONFIGS / "llama-3-8b-int4.json"}
# nominal DRAM bandwidth in GB/s by device name (most specific first)
PEAK_GBS = [
    ("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100 NVL", 3900.0), ("H100", 3350.0),
    ("A100", 1555.0),  # the 40GB parts; any A100 with 80GB in its name is taken as 2000 below
    ("RTX 4090", 1008.0), ("L40S", 864.0), ("L40", 864.0), ("L4", 300.0), ("A10G", 600.0), ("RTX 3090", 936.0), ("T4", 320.0),
]


def peak_gbs_for(name: str) -> float | None:
    """The nominal bandwidth of a device by its name (None when it is not in the table)."""
    for key, gbs in PEAK_GBS:
        if key.lower() in name.lower():
            if key == "A100" and "80GB" in name:
                return 2000.0
            return gbs
    return None


def free_gpu() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def decode_bytes_per_token(lm, context: int) -> int:
    """Bytes one batch-1 decode step reads: every layer matrix, norm and the output head as stored, one row of the
    embedding, and the K/V of `context` tokens."""
    from edgeserve.engine.cache.kv_cache import kv_bytes_per_token
    from edgeserve.models.dummy import weight_bytes

    c, m = lm.config, lm.model
    group = None
    qkv = m.layers[0].qkv
    if hasattr(qkv, "group_size"):
        group = qkv.group_size
    total = weight_bytes(c, m.dtype, group)
    e = torch.empty((), dtype=m.dtype).element_size()
    if not c.tie_word_embeddings:  # the embedding table is looked up (one row), not read whole
        total -= c.vocab_size * c.hidden_size * e - c.hidden_size * e
    return total + context * kv_bytes_per_token(c, m.dtype)


def batch1_decode(lm, graphs: bool, prompt_len: int, steps: int, max_batched: int,
                  overlap: bool = True) -> tuple[float, int]:
    """(seconds per decode token, mean context) of one request: a prompt of `prompt_len`, then `steps` tokens;
    `overlap`: launch each step before the previous one's token reaches the host (--overlap)."""
    from edgeserve.llm import LLM
    from edgeserve.sampling_params import SamplingParams

    llm = LLM.from_model(lm, max_num_seqs=1, max_num_batched_tokens=max_batched,
                         max_model_len=prompt_len + steps + 16, enforce_eager=not graphs,
                         overlap="on" if overlap else "off")
    if graphs and llm.engine.runner.graphs is None:
        raise SystemExit("CUDA graphs were asked for but the engine did not capture any (Triton missing?)")
    core = llm.engine
    ids = torch.randint(256, lm.config.vocab_size, (prompt_len,)).tolist()
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for _ in range(2):  # warm-up request (Triton compiles, allocator settles), then the measured one
        core.add_request(ids, params)
        times = []
        while core.has_work():  # no synchronize per step: it would undo the overlap (a step's tokens sync)
            outs = core.step()
            if any(o.token_ids for o in outs):
                times.append(time.perf_counter())
    decode = times[1: steps + 1]  # times[0] is the prefill step's token
    per_token = (decode[-1] - times[0]) / len(decode)
    del llm, core
    free_gpu()
    return per_token, prompt_len + len(decode) // 2


def engine_throughput(lm, n: int, prompt_len: int, out_len: int, max_batched: int, fraction: float) -> float:
    """Output tokens/s of `n` concurrent requests through the engine (graphs on)."""
    from edgeserve.llm import LLM
    from edgeserve.sampling_params import SamplingParams

    llm = LLM.from_model(lm, max_num_seqs=max(n, 1), max_num_batched_tokens=max(max_batched, prompt_len),
                         max_model_len=prompt_len + out_len + 16, gpu_memory_fraction=fraction)
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    gen = torch.Generator().manual_seed(n)
    prompts = [torch.randint(256, lm.config.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(n)]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    torch.cuda.synchronize()
    dt = time.perf_counter() - start
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    del llm
    free_gpu()
    return tokens / dt


def transformers_throughput(config_path: Path, n: int, prompt_len: int, out_len: int, dtype: torch.dtype) -> float:
    """Output tokens/s of transformers' generate() on a static batch of `n` (random weights, same shape)."""
    import transformers

    cfg = json.loads(config_path.read_text())
    cfg.pop("quantization_config", None)  # transformers' reference runs dense (bf16)
    config = transformers.LlamaConfig.from_dict(cfg)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            model = transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    ids = torch.randint(256, config.vocab_size, (n, prompt_len), device="cuda")
    kwargs = dict(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:1, :16], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        torch.cuda.synchronize()
    dt = time.perf_counter() - start
    tokens = (out.shape[1] - prompt_len) * n
    del model, out
    free_gpu()
    return tokens / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="bf16,int4", help="which dummy Llama-3-8B variants (bf16, int4)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=128, help="decode tokens timed at batch 1")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--gpu-memory-fraction", type=float, default=0.9)
    ap.add_argument("--bandwidth-gbs", type=float, default=None, help="the device's peak bandwidth (GB/s) to compare with")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--default-model", default=None, help="path or name of the default model (default: smollm2-135m if pulled)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_decode.py needs a CUDA GPU and torch sees none: nothing measured", file=sys.stderr)
        raise SystemExit(1)

    from edgeserve.device import device_info
    from edgeserve.kernels import dispatch
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    dev = torch.device("cuda")
    info = device_info(dev)
    peak = a.bandwidth_gbs or peak_gbs_for(info.name)
    if peak is None:
        from edgeserve.kernels.triton.bench import peak_bandwidth_gbs

        peak = peak_bandwidth_gbs(dev)
    print(f"device: {info.describe()}; triton kernels: {dispatch.use_triton(dev)}; torch {torch.__version__}")
    print(f"peak bandwidth: {f'{peak:.0f} GB/s' if peak else 'unknown (pass --bandwidth-gbs)'}"
          f"{' (--bandwidth-gbs)' if a.bandwidth_gbs else ''}")

    variants = [v.strip() for v in a.models.split(",") if v.strip()]
    levels = [int(x) for x in a.concurrency.split(",")]
    batch1_lines, throughput = [], {}
    for v in variants:  # one model on the GPU at a time
        start = time.perf_counter()
        lm = load_model(resolve(str(MODELS[v])), device="cuda", load_format="dummy")
        print(f"# {v}: dummy Llama-3-8B loaded in {time.perf_counter() - start:.1f}s, "
              f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated", flush=True)
        for graphs, overlap in ((True, True), (True, False), (False, True)):
            sec, context = batch1_decode(lm, graphs, a.prompt_len, a.decode_steps, a.max_batched_tokens, overlap)
            nbytes = decode_bytes_per_token(lm, context)
            gbs = nbytes / sec / 1e9
            pct = f"{100 * gbs / peak:6.1f}%" if peak else "     ?"
            batch1_lines.append(f"{v:<8} {'on' if graphs else 'off':<7} {'on' if overlap else 'off':<8} "
                                f"{sec * 1e3:9.2f} {1 / sec:9.1f} {nbytes / 1e9:9.2f} {gbs:7.0f} {pct:>7}")
            print(f"# {batch1_lines[-1]}", flush=True)
        if not a.skip_throughput:
            throughput[v] = [engine_throughput(lm, n, a.prompt_len, a.output_len, a.max_batched_tokens,
                                               a.gpu_memory_fraction) for n in levels]
        del lm
        free_gpu()

    print(f"\n# batch-1 decode, dummy Llama-3-8B, prompt {a.prompt_len}, {a.decode_steps} tokens timed")
    print(f"{'weights':<8} {'graphs':<7} {'overlap':<8} {'ms/token':>9} {'tokens/s':>9} {'GB/token':>9} {'GB/s':>7} {'% peak':>7}")
    print("\n".join(batch1_lines), flush=True)

    if not a.skip_throughput:
        hf = {}
        if not a.skip_transformers:
            for n in levels:
                try:
                    hf[n] = transformers_throughput(MODELS["bf16"], n, a.prompt_len, a.output_len, torch.bfloat16)
                except Exception as e:  # out of memory at a high batch, or transformers missing
                    print(f"# transformers at {n}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
                    free_gpu()
        print(f"\n# aggregate output tokens/s, {a.prompt_len} prompt / {a.output_len} output tokens per request")
        header = f"{'concurrency':>11}" + "".join(f" {'edgeserve ' + v:>16}" for v in throughput)
        if not a.skip_transformers:
            header += f" {'transformers bf16':>18}"
        print(header)
        for i, n in enumerate(levels):
            line = f"{n:>11}" + "".join(f" {t[i]:16.1f}" for t in throughput.values())
            if not a.skip_transformers:
                line += f" {hf[n]:18.1f}" if n in hf else f" {'-':>18}"
            print(line, flush=True)

    print("\n# default model, single stream")
    try:
        from edgeserve.registry import DEFAULT_MODEL

        lm = load_model(resolve(a.default_model or DEFAULT_MODEL, pull_missing=False), device="cuda")
    except Exception as e:
        print(f"skipped: {e}")
        return
    for graphs in (True, False):
        sec, _ = batch1_decode(lm, graphs, 64, a.decode_steps, a.max_batched_tokens)
        print(f"{lm.name} ({lm.model.dtype}, graphs {'on' if graphs else 'off'}): {1 / sec:.1f} tokens/s "
              f"({sec * 1e3:.2f} ms/token)", flush=True)


if __name__ == "__main__":
    main()
