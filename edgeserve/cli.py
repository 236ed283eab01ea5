"""The `edgeserve` command line: pull, list, run and serve models."""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

from edgeserve.engine.cache.kv_dtypes import KV_CACHE_DTYPES
from edgeserve.engine.config import LORA_WEIGHTS, EngineConfig
from edgeserve.errors import EdgeserveError, one_line_parse_errors, run_reporting_errors
from edgeserve.registry import CATALOG, DEFAULT_MODEL
from edgeserve.registry.catalog import HF_CATALOG
from edgeserve.server.config import DEFAULT_MAX_TOKENS  # edgeserve.server loads its app lazily: this stays light


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    from edgeserve import __version__

    parser = argparse.ArgumentParser(prog="edgeserve", description="A local LLM server and runner.")
    parser.add_argument("--version", action="version", version=f"edgeserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True,
                                title="commands (edgeserve COMMAND --help for each one's flags)")

    p = sub.add_parser("pull", help="download a catalog or Hugging Face model into the cache folder")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL,
                   help=f"catalog name ({', '.join([*CATALOG, *HF_CATALOG])}), hf.co/OWNER/REPO[:QUANT] "
                        "(a GGUF file) or OWNER/REPO "
                        "(a safetensors repository)")

    ls = sub.add_parser("list", help="list pulled models (--all: every catalog model, with sizes)")
    ls.add_argument("--all", action="store_true", help="also list catalog models that are not pulled")

    rm = sub.add_parser("rm", help="delete a pulled model from the cache folder")
    rm.add_argument("name", help="catalog name or Hugging Face name, as `edgeserve list` shows it")

    r = sub.add_parser("run", help="generate a reply to a prompt, streamed to the terminal")
    r.add_argument("args", nargs="*", metavar="[MODEL] PROMPT",
                   help=f"model (catalog name, .gguf path or HF folder; default {DEFAULT_MODEL}) and prompt; "
                        "with no prompt: chat interactively, or read the prompt from stdin")
    r.add_argument("--model", "-m", default=None, help=f"model to run (default {DEFAULT_MODEL})")
    r.add_argument("--max-tokens", type=int, default=256, help="the most tokens of the reply")
    r.add_argument("--temperature", type=float, default=0.7, help="sampling temperature; 0 is greedy")
    r.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling: the smallest set of this mass")
    r.add_argument("--top-k", type=int, default=0, help="draw from the k most likely tokens (0: off)")
    r.add_argument("--min-p", type=float, default=0.0, help="drop tokens under this fraction of the best's probability")
    r.add_argument("--seed", type=int, default=None, help="random seed, for a repeatable reply")
    r.add_argument("--system", default=None, help="system message for the chat template")
    r.add_argument("--raw", action="store_true", help="send the prompt as it is, without the chat template")
    r.add_argument("--image", action="append", default=None, metavar="FILE",
                   help="an image (PNG, JPEG, WebP, GIF) before the prompt; repeat for several (a vision model)")
    add_mmproj_arg(r)
    r.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="compute dtype (auto: bfloat16, float16 on sm_75 GPUs; on CPU 4-bit weights stay packed; "
                        "float32 dequantizes everything, slower but closest to a reference)")
    add_quantize_args(r)
    add_device_args(r)
    r.add_argument("--verbose", "-v", action="store_true", help="print load time and tokens/s to stderr")
    add_engine_args(r)

    add_serve_args(sub.add_parser("serve", help="serve models over OpenAI- and Ollama-compatible HTTP (models load "
                                                "lazily)"))
    c = sub.add_parser("cluster", help="serve N replicas on a Ray cluster behind one HTTP ingress, routed by prompt "
                                       "prefix (needs the `cluster` extra)")
    add_serve_args(c)
    add_cluster_args(c)

    b = sub.add_parser("bench", help="benchmark an OpenAI-compatible server (or a fresh edgeserve) with streaming load")
    add_bench_args(b)
    parser.subcommand_parsers = list(sub.choices.values())  # type: ignore[attr-defined]
    for p in parser.subcommand_parsers:  # type: ignore[attr-defined]
        p.formatter_class = DefaultsHelpFormatter
    return parser


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that ends each flag's line with its default, where it has one worth saying (not None, off or empty)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or not action.option_strings or default is None or default is False
                or default is argparse.SUPPRESS or (isinstance(default, (list, tuple)) and not default)
                or isinstance(action, argparse._VersionAction)):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def add_serve_args(s: argparse.ArgumentParser) -> None:
    """`serve`'s flags (address, models, key, limits, model and engine options), shared by `cluster`."""
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    s.add_argument("--model", "-m", action="append", default=None,
                   help=f"a model to serve (catalog name, .gguf path or HF folder); repeat for several; "
                        f"default {DEFAULT_MODEL}")
    s.add_argument("--api-key", default=os.environ.get("EDGESERVE_API_KEY"),
                   help="require `Authorization: Bearer KEY` on every API route but /health "
                        "(default: $EDGESERVE_API_KEY)")
    s.add_argument("--keep-alive", default="5m",
                   help="unload a model after this long without requests (e.g. 30s, 5m, 1h; -1: never)")
    s.add_argument("--max-loaded-models", type=int, default=1,
                   help="models loaded at once; the least recently used idle one is unloaded for another")
    s.add_argument("--max-queue", type=int, default=EngineConfig.max_waiting,
                   help="waiting requests per model before HTTP 429 (default %(default)s)")
    s.add_argument("--default-max-tokens", type=_count_or_off, default=DEFAULT_MAX_TOKENS, metavar="N|off",
                   help="output tokens of a request that sets no limit (default %(default)s; off: up to the end of "
                        "the context)")
    s.add_argument("--max-tokens-limit", type=_count_or_off, default=None, metavar="N|off",
                   help="the most output tokens any request gets; larger limits are lowered to it (default: off)")
    s.add_argument("--max-blob-bytes", type=int, default=8 * 1024 ** 3, metavar="N",
                   help="the largest file a client may push to /api/blobs (an adapter for /api/create); it streams "
                        "to disk (default %(default)s: 8 GiB)")
    s.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="compute dtype (auto: bfloat16, float16 on sm_75 GPUs)")
    add_device_args(s)
    add_quantize_args(s)
    s.add_argument("--no-pull", action="store_true",
                   help="do not download missing catalog models (at start or through POST /api/pull)")
    add_mmproj_arg(s)
    s.add_argument("--allow-image-urls", action="store_true",
                   help="fetch http(s) image URLs in requests (size and time limited); without it only data URLs "
                        "and base64 images are taken")
    s.add_argument("--tool-format", default=None, metavar="NAME",
                   help="read every model's tool calls and reasoning in this format instead of the one detected "
                        "from its chat template (docs/SERVER.md lists them: hermes, qwen3_coder, gemma4, ...)")
    add_engine_args(s)
    s.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info",
                   help="the least important log lines printed")


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    """`cluster`'s own flags: where Ray runs, how many replicas of what size, how requests are routed."""
    from edgeserve.cluster.affinity import DEFAULT_MAX_IMBALANCE

    g = parser.add_argument_group("cluster")
    g.add_argument("--address", default=None, metavar="auto|HOST:PORT",
                   help="join a running Ray cluster (`ray start --head` on one machine, `ray start --address` on the "
                        "others); default: start Ray on this machine for this command")
    g.add_argument("--replicas", type=int, default=2, help="edgeserve replicas (default %(default)s)")
    g.add_argument("--num-cpus", type=float, default=1.0, help="CPU cores Ray reserves per replica (default "
                                                               "%(default)s)")
    g.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per replica (default %(default)s)")
    g.add_argument("--routing", choices=["prefix", "pow2"], default="prefix",
                   help="prefix: a request goes to the replica holding its longest prompt prefix unless that one is "
                        "overloaded; pow2: Ray's power-of-two choices (default %(default)s)")
    g.add_argument("--max-imbalance", type=int, default=DEFAULT_MAX_IMBALANCE, metavar="N",
                   help="skip the replica holding the prefix when it has more than N requests in flight above the "
                        "least loaded replica (default %(default)s)")


def _comma_list(kind):
    """An argparse type: a comma-separated list of positive `kind` values (e.g. `1,4,8`)."""
    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list of numbers, got {text!r}") from None
        if not values or any(not v > 0 for v in values):
            raise argparse.ArgumentTypeError(f"expected positive values, got {text!r}")
        return values
    return parse


def add_bench_args(b: argparse.ArgumentParser) -> None:
    """`bench`'s flags (see README, Benchmarking)."""
    b.add_argument("--url", default=None, help="an OpenAI-compatible server's base URL (default: start edgeserve "
                                               "on --model on a free port and stop it at the end)")
    b.add_argument("--model", "-m", default=None,
                   help=f"the model to serve, and whose tokenizer builds the prompts (default {DEFAULT_MODEL} "
                        "without --url)")
    b.add_argument("--served-model-name", default=None, help="the `model` field sent (default: /v1/models' first)")
    b.add_argument("--workload", choices=["fixed", "chat", "copy"], default="fixed",
                   help="fixed lengths, a seeded chat mix of lengths around them, or copy (the answer repeats "
                        "the prompt)")
    b.add_argument("--num-requests", type=int, default=32, help="requests per load level (default %(default)s)")
    b.add_argument("--duration", type=float, default=None, help="seconds per load level at most")
    b.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (chat: mean) (default %(default)s)")
    b.add_argument("--max-tokens", type=int, default=128, help="output length (chat: mean) (default %(default)s)")
    b.add_argument("--shared-prefix-tokens", type=int, default=0,
                   help="a prefix of this many tokens shared by every request, before --prompt-tokens distinct ones")
    b.add_argument("--concurrency", type=_comma_list(int), default=None,
                   help="requests in flight (closed loop); a comma list sweeps (default 1)")
    b.add_argument("--request-rate", type=_comma_list(float), default=None,
                   help="Poisson arrivals per second (open loop, seeded; inf: all at once); a comma list sweeps")
    b.add_argument("--seed", type=int, default=0, help="random seed of the run (prompts, arrivals)")
    b.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (default %(default)s: greedy)")
    b.add_argument("--top-p", type=float, default=1.0, help="top_p of every request (default %(default)s: off)")
    b.add_argument("--slo-ttft", type=float, default=None, help="goodput SLO: time to first token, ms")
    b.add_argument("--slo-tpot", type=float, default=None, help="goodput SLO: time per output token, ms")
    b.add_argument("--prompt-format", choices=["auto", "ids", "text"], default="auto",
                   help="auto: token ids where the server takes them (edgeserve, llama-server), else text")
    b.add_argument("--warmup", type=int, default=1, help="unmeasured requests first (default %(default)s)")
    b.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON (- for stdout)")
    b.add_argument("--plot", default=None, metavar="FILE.png",
                   help="plot throughput and p99 TTFT/TPOT against the sweep (needs the `plot` extra)")
    b.add_argument("--roofline", action="store_true",
                   help="print the memory-bandwidth bound on single-stream decode next to the measured rate")
    b.add_argument("--mem-bandwidth-gbs", type=float, default=None,
                   help="memory bandwidth for --roofline (default: measured host memcpy)")
    b.add_argument("--max-seqs", type=int, default=8, help="--max-seqs of the edgeserve started (default %(default)s)")
    b.add_argument("--server-timeout", type=float, default=300.0, help="seconds to wait for a started server")
    b.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def add_quantize_args(parser: argparse.ArgumentParser) -> None:
    """Quantize-on-load flags (a load option, like --dtype), shared by `run` and `serve`."""
    g = parser.add_argument_group("quantization")
    g.add_argument("--quantize", choices=["int4"], default=None,
                   help="quantize a float (bf16/fp16/fp32) model's layer weights to group-wise INT4 at load time")
    g.add_argument("--quantize-group-size", type=int, default=128, choices=[32, 64, 128, 256], metavar="N",
                   help="input columns per INT4 scale/offset group: 32, 64, 128 or 256 (default %(default)s)")
    g.add_argument("--quantize-calibration", default=None, metavar="FILE",
                   help="a text file run through the model first for activation-aware (AWQ-style) scaling")
    g.add_argument("--dense-prefill", choices=["auto", "on", "off"], default="auto",
                   help="CPU, 4-bit weights: also keep a bf16 copy of each matrix for prompt tokens (torch's int4 "
                        "kernel is fast for decode, slow for long prompts); auto: on when the copies take at most a "
                        "quarter of the free memory (default %(default)s)")


class _MmprojAction(argparse.Action):
    """--mmproj FILE: kept as `mmproj` (the last one) and, in `mmproj_pairs`, with the index of the -m it follows
    (-1 before any), so that `serve -m VLM --mmproj MM -m other` ties MM to VLM alone."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        models = getattr(namespace, "model", None)
        index = len(models) - 1 if isinstance(models, list) else -1
        namespace.mmproj = values
        namespace.mmproj_pairs = [*(getattr(namespace, "mmproj_pairs", None) or []), (index, values)]


def add_mmproj_arg(parser: argparse.ArgumentParser) -> None:
    """--mmproj, shared by `run` and `serve`."""
    parser.add_argument("--mmproj", default=None, metavar="FILE", action=_MmprojAction,
                        help="a vision projector GGUF (llama.cpp's mmproj) for the GGUF model given before it (-m "
                             "VLM --mmproj FILE; before any -m: the first model), to take images; an mmproj beside "
                             "the model file, or an HF folder's vision tower, is found without it")


def mmproj_pairs(args: argparse.Namespace, models: list[str]) -> tuple[tuple[str, str], ...]:
    """(model, projector) of each `serve --mmproj`, tied to the -m before it; one line for a model given two."""
    pairs: dict[str, str] = {}
    for index, path in getattr(args, "mmproj_pairs", None) or []:
        model = models[max(index, 0)]
        if model in pairs:
            raise EdgeserveError(f"--mmproj: model {model} already has a projector ({pairs[model]}); give one "
                                 "--mmproj after each -m that needs one")
        pairs[model] = path
    return tuple(pairs.items())


def add_device_args(parser: argparse.ArgumentParser) -> None:
    """--device and --load-format, shared by `run` and `serve`."""
    parser.add_argument("--device", default="auto",
                        help="auto (default: cuda when torch sees a GPU, else cpu), cpu, cuda or cuda:N")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                        help="dummy: random weights of the shape in MODEL's config.json (a config.json file or a "
                             "folder holding one; 4-bit if its quantization_config says bits 4), for benchmarking")
    parser.add_argument("--cpu-moe-layers", type=cpu_moe_layers_arg, default=None, metavar="N|all",
                        help="MoE models on a GPU: keep the routed experts of the first N MoE layers (or all) in host "
                             "memory on the CPU kernels, the rest on the GPU (llama.cpp's --n-cpu-moe); a no-op on "
                             "a CPU run")


def cpu_moe_layers_arg(value: str) -> int | str | None:
    """argparse type of --cpu-moe-layers: a non-negative integer or "all" (edgeserve.models.cpu_moe)."""
    from edgeserve.models.cpu_moe import FLAG, parse_cpu_moe_layers

    try:
        return parse_cpu_moe_layers(value)
    except ValueError as e:  # argparse names the flag itself
        raise argparse.ArgumentTypeError(str(e).removeprefix(FLAG + " ")) from None


def check_device(args: argparse.Namespace) -> None:
    """Refuse a device this machine cannot use now, as one line (not a traceback at load time)."""
    from edgeserve.device import resolve_device, resolve_dtype

    resolve_dtype(args.dtype, resolve_device(args.device))


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (KV pool size, batch limits, context length), shared by `run` and `serve`."""
    g = parser.add_argument_group("engine")
    g.add_argument("--kv-cache-gb", type=float, default=None,
                   help="KV cache pool size in GiB (default: a tenth of the memory free after loading)")
    g.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default=EngineConfig.kv_cache_dtype,
                   help="what the KV cache stores: auto (the compute dtype; f16 beside bf16 compute on the CPU), "
                        "bf16, f16, or q8_0 (CPU: about half "
                        "the bytes, so the same --kv-cache-gb holds about twice the tokens; see README for the "
                        "quality cost) (default %(default)s)")
    g.add_argument("--max-seqs", type=int, default=EngineConfig.max_num_seqs,
                   help="most sequences batched in one step (default %(default)s)")
    g.add_argument("--max-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens,
                   help="most tokens in one step; longer prompts are prefilled in chunks (default %(default)s)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length in tokens, prompt and output together (default: the model's)")
    g.add_argument("--no-prefix-cache", action="store_true", help="do not reuse the KV of shared prompt prefixes")
    g.add_argument("--gpu-memory-fraction", type=float, default=EngineConfig.gpu_memory_fraction,
                   help="share of the GPU's memory for weights, activations and the KV cache; the KV pool gets what "
                        "is left after the weights and a warm-up step (default %(default)s; CUDA only, "
                        "--kv-cache-gb overrides)")
    g.add_argument("--eager", action="store_true",
                   help="no CUDA graphs: run decode steps eagerly (graphs are used on CUDA GPUs only; on CPU every "
                        "step is eager anyway)")
    g.add_argument("--overlap", choices=["auto", "on", "off"], default=EngineConfig.overlap,
                   help="launch each step before the previous step's tokens reach the host, so the device never "
                        "waits on host work (default %(default)s: on for CUDA GPUs, off on CPU where steps run "
                        "synchronously)")
    g.add_argument("--kv-offload", default=EngineConfig.kv_offload, metavar="none|cpu|cpu,disk",
                   help="keep KV blocks evicted from the pool in RAM (cpu) and on disk (cpu,disk), and swap "
                        "preempted requests to RAM (default %(default)s)")
    g.add_argument("--cpu-kv-gb", type=float, default=EngineConfig.cpu_kv_gb,
                   help="host-memory KV tier size in GiB (default %(default)s)")
    g.add_argument("--disk-kv-gb", type=float, default=EngineConfig.disk_kv_gb,
                   help="disk KV tier size in GiB (default %(default)s)")
    g.add_argument("--disk-kv-path", default=None,
                   help="disk KV tier folder (default: kv/ under the edgeserve cache folder)")
    _add_spec_args(g)
    g.add_argument("--lora", action="append", type=_lora_flag, default=[], metavar="NAME=PATH",
                   help="a LoRA adapter (PEFT folder or GGUF LoRA file) requests may pick by model NAME or "
                        "BASE:NAME (repeatable; `run` uses it for its replies)")
    g.add_argument("--max-loras", type=int, default=EngineConfig.max_loras,
                   help="LoRA adapters resident at once; the least recently used idle one is unloaded to make room "
                        "(default %(default)s)")
    g.add_argument("--lora-weights", choices=list(LORA_WEIGHTS), default=EngineConfig.lora_weights,
                   help="what the CPU decoder reads of each adapter per step: int8 (a scale per rank row, half "
                        "bfloat16's bytes), float (the model's dtype), auto: int8 beside a quantized base "
                        "(default %(default)s)")
    g.add_argument("--max-decode-slowdown", type=_factor_or_off, default=EngineConfig.max_decode_slowdown,
                   help="while requests decode, a step carries only the prompt tokens that keep it within this "
                        "factor of a decode-only step; off: every step takes the whole --max-batched-tokens "
                        "(default %(default)s)")


def _add_spec_args(g) -> None:
    """The speculative decoding flags (an argument group of add_engine_args)."""
    g.add_argument("--speculative", choices=["auto", "off", "ngram", "draft", "mtp"], default="auto",
                   help="speculative decoding: mtp (the model's own multi-token-prediction head: Qwen3.5 / 3.6), "
                        "ngram (prompt lookup), draft (--draft) or off; auto (default): draft with --draft, else mtp "
                        "where the model has a head, else off")
    g.add_argument("--draft", "--draft-model", dest="draft_model", default=None, metavar="PATH",
                   help="draft model (catalog name or path): one with the same tokenizer, or a Gemma 4 assistant")
    g.add_argument("--num-speculative-tokens", "--spec-tokens", dest="num_speculative_tokens", type=int,
                   default=EngineConfig.num_speculative_tokens,
                   help="tokens proposed per sequence per step (default: 1 with mtp or a Gemma 4 assistant, else 4)")
    g.add_argument("--spec-draft-vocab", type=int, default=EngineConfig.spec_draft_vocab, metavar="N",
                   help="the MTP head drafts within the lowest N token ids (its output head cut to them, read once "
                        "per draft); outputs do not change, only how often drafts are right; 0: the whole vocabulary "
                        "(default: 32768)")


def _count_or_off(text: str) -> int | None:
    """A token-count flag's value: a positive integer, or "off" (None)."""
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of tokens or 'off', got {text!r}")
    return value


def _lora_flag(text: str) -> tuple[str, str]:
    """A --lora value: NAME=PATH."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip() or ":" in name or "/" in name:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (a name without ':' or '/'), got {text!r}")
    return name.strip(), path.strip()


def _factor_or_off(text: str) -> float | None:
    """A --max-decode-slowdown value: a number, or "off" (None)."""
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of at least 1.0 or 'off', got {text!r}") from None


def engine_config_from_args(args: argparse.Namespace, **fields) -> EngineConfig:
    """The EngineConfig of the engine flags (plus `fields`); a bad value is EngineConfig's own one-line
    ConfigError, which names the flag."""
    return EngineConfig(kv_cache_gb=args.kv_cache_gb, kv_cache_dtype=args.kv_cache_dtype,
                        max_num_seqs=args.max_seqs,
                        max_num_batched_tokens=args.max_batched_tokens, max_model_len=args.max_model_len,
                        enable_prefix_caching=not args.no_prefix_cache, kv_offload=args.kv_offload,
                        gpu_memory_fraction=args.gpu_memory_fraction, enforce_eager=args.eager, overlap=args.overlap,
                        cpu_kv_gb=args.cpu_kv_gb, disk_kv_gb=args.disk_kv_gb, disk_kv_path=args.disk_kv_path,
                        speculative=args.speculative, draft_model=args.draft_model,
                        num_speculative_tokens=args.num_speculative_tokens, spec_draft_vocab=args.spec_draft_vocab,
                        max_decode_slowdown=args.max_decode_slowdown, loras=tuple(args.lora),
                        max_loras=args.max_loras, lora_weights=args.lora_weights, **fields)


def names_model(text: str) -> bool:
    """Whether `text` is a catalog name or an existing file or folder (a long prompt is neither: no error)."""
    if text in CATALOG:
        return True
    try:
        return Path(text).expanduser().exists()
    except (OSError, ValueError):  # longer than a file name may be, or holds a NUL byte: not a path
        return False


def split_model_and_prompt(args: argparse.Namespace) -> tuple[str, str | None]:
    """Read `run`'s positionals as [MODEL] [PROMPT]: a lone word names a model only if it is one."""
    pos = list(args.args)
    model = args.model
    if model is None and len(pos) >= 2:
        model = pos.pop(0)
    elif model is None and len(pos) == 1 and names_model(pos[0]):
        model = pos.pop(0)
    if len(pos) > 1:
        raise EdgeserveError("run takes at most a model and one prompt; quote the prompt")
    return model or DEFAULT_MODEL, (pos[0] if pos else None)


def cmd_pull(args: argparse.Namespace) -> int:
    from edgeserve.registry import pull

    path = pull(args.name, progress=True)
    print(path)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    """Print the pulled models (with --all every catalog model too) as aligned columns under a header."""
    from edgeserve.registry import cached_path, is_pulled
    from edgeserve.registry.hf import list_pulled, local_path

    rows = []
    for name, entry in CATALOG.items():
        pulled = is_pulled(name)
        if pulled or args.all:
            rows.append((name, entry.kind, f"{entry.size_bytes / 1e6:.1f} MB", entry.license.split(" (")[0],
                         str(cached_path(name)) if pulled else "not pulled"))
    for name, hf_entry in HF_CATALOG.items():
        if args.all and local_path(name) is None:
            rows.append((name, hf_entry.kind, f"~{hf_entry.approx_size_bytes / 1e6:.0f} MB",
                         hf_entry.license.split(" (")[0], f"not pulled ({hf_entry.hf})"))
    kinds = {e.hf: (e.kind, e.license.split(" (")[0]) for e in HF_CATALOG.values()}  # a short name's pull
    for name, path in list_pulled():
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
        kind, license = kinds.get(name, ("", ""))
        rows.append((name, kind, f"{size / 1e6:.1f} MB", license, str(path)))
    if rows:
        print_columns([("NAME", "KIND", "SIZE", "LICENSE", "WHERE"), *rows], right=(2,))
    return 0


def print_columns(rows: list[tuple[str, ...]], right: tuple[int, ...] = ()) -> None:
    """Print `rows` as columns two spaces apart, each as wide as its widest cell (`right`: right-aligned ones)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        print("  ".join(cells).rstrip())


def cmd_rm(args: argparse.Namespace) -> int:
    from edgeserve.registry import remove

    for path in remove(args.name):
        print(f"removed {path}")
    return 0


def _run_params(args: argparse.Namespace):
    """`run`'s sampling flags as SamplingParams; a bad value is one line (before torch is imported)."""
    from edgeserve.sampling_params import SamplingParams

    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, min_p=args.min_p, seed=args.seed)
    except ValueError as e:
        raise EdgeserveError(str(e)) from None


def _load_for_run(args: argparse.Namespace, model_name: str, config):
    """The LLM `run` talks to, loaded with a loading line (an unknown model's line comes first)."""
    from edgeserve.first_run import first_run_hint
    from edgeserve.llm import LLM
    from edgeserve.load_progress import LoadingLine
    from edgeserve.serve_checks import check_models

    first_run_hint(model_name)
    check_models([model_name], allow_pull=True, load_format=args.load_format)
    # on a terminal its own line before the loading line, as that one (piped, stderr keeps to errors)
    start_native_build(args.device, args.cpu_moe_layers, say_it=sys.stderr.isatty()).join()
    with LoadingLine(model_name):
        llm = LLM(model_name, config=config, mmproj=args.mmproj, load=load_config_from_args(args))
    if config.kv_offload != "none":
        import atexit

        atexit.register(llm.close)  # the disk tier keeps this run's prefixes for the next one
    if args.verbose:
        print(f"loaded {llm.lm.name} in {llm.lm.load_seconds:.2f}s", file=sys.stderr)
    return llm


def _run_reply(llm, args: argparse.Namespace, params, adapter: str | None, images: list, messages: list[dict],
               text: str) -> str:
    """Stream one reply of `run` to stdout (a harmony model's reasoning to stderr) and return its answer text."""
    import time

    from edgeserve.text.chat_prompt import chat_ids
    from edgeserve.text.harmony import HarmonyParser, template_is_harmony

    lm = llm.lm
    request: dict = {}
    if args.raw:
        ids = lm.tokenizer.encode(text)
    elif images and len(messages) == 1 + bool(args.system):
        ids, request = llm.image_prompt(text, images, args.system)  # the images go with the first turn
    else:
        ids = chat_ids(lm.tokenizer, lm.chat_template, messages)
    out = []
    start = time.perf_counter()
    n = 0
    # a harmony (gpt-oss) reply: the answer on stdout, the reasoning on stderr, no format markers
    parser = HarmonyParser() if not args.raw and template_is_harmony(lm.chat_template.source) else None
    for delta in llm.stream(ids, params, adapter=adapter, **request):
        n += len(delta.token_ids)
        piece = delta.text
        if parser is not None:
            thought, piece = parser.push(piece)
            if delta.finish_reason is not None:
                more, tail, _ = parser.finish()
                thought, piece = thought + more, piece + tail
            sys.stderr.write(thought)
        out.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if args.verbose:
        dt = time.perf_counter() - start
        print(f"[{len(ids)} prompt tokens, {n} generated in {dt:.2f}s, {n / dt:.1f} tokens/s]", file=sys.stderr)
    return "".join(out)


def cmd_run(args: argparse.Namespace) -> int:
    model_name, prompt = split_model_and_prompt(args)
    params = _run_params(args)  # the flags first: a bad value is one line before torch is imported
    config = engine_config_from_args(args)
    check_device(args)
    if len(config.loras) > 1:
        raise EdgeserveError("run takes one --lora adapter (serve takes several)")
    adapter = config.loras[0][0] if config.loras else None
    llm = _load_for_run(args, model_name, config)
    images = _read_images(args.image) if args.image else []
    if images and (args.raw or llm.lm.vision is None):
        raise EdgeserveError("--image needs a vision model through its chat template (no --raw; a GGUF model needs "
                             "--mmproj)")

    def reply(messages: list[dict], text: str) -> str:
        return _run_reply(llm, args, params, adapter, images, messages, text)

    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    if prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read()
    if prompt is not None:
        reply(messages + [{"role": "user", "content": prompt}], prompt)
        return 0
    print(f"chatting with {llm.lm.name}; an empty line or Ctrl-D ends", file=sys.stderr)
    while True:
        try:
            text = input(">>> ")
        except EOFError:
            break
        if not text.strip():
            break
        messages.append({"role": "user", "content": text})
        messages.append({"role": "assistant", "content": reply(messages, text)})
    return 0


def load_config_from_args(args: argparse.Namespace):
    """The LoadConfig of `run`'s load flags (--dtype, --device, --load-format, --quantize*, --dense-prefill,
    --cpu-moe-layers)."""
    from edgeserve.models.load_config import LoadConfig

    return LoadConfig(dtype=args.dtype, device=args.device, load_format=args.load_format, quantize=args.quantize,
                      quantize_group_size=args.quantize_group_size, quantize_calibration=args.quantize_calibration,
                      dense_prefill=args.dense_prefill, cpu_moe_layers=args.cpu_moe_layers)


def server_config_from_args(args: argparse.Namespace):
    """ServerConfig from `serve`'s flags, its `engine` built from the engine flags; a bad value is the config
    dataclasses' own one-line ConfigError."""
    from edgeserve.server import ServerConfig
    from edgeserve.server.config import parse_keep_alive

    engine = engine_config_from_args(args, max_waiting=args.max_queue)  # a bad flag fails now, not at first load
    models = list(args.model or [DEFAULT_MODEL])
    config = ServerConfig(
        host=args.host, port=args.port, models=tuple(models), api_key=args.api_key or None,
        keep_alive=parse_keep_alive(args.keep_alive), max_loaded_models=args.max_loaded_models,
        engine=engine, dtype=args.dtype, quantize=args.quantize, quantize_group_size=args.quantize_group_size,
        quantize_calibration=args.quantize_calibration, dense_prefill=args.dense_prefill, device=args.device,
        load_format=args.load_format, cpu_moe_layers=args.cpu_moe_layers, allow_pull=not args.no_pull,
        log_level=args.log_level, mmproj=mmproj_pairs(args, models), allow_image_urls=args.allow_image_urls,
        default_max_tokens=args.default_max_tokens, max_tokens_limit=args.max_tokens_limit,
        tool_format=args.tool_format, max_blob_bytes=args.max_blob_bytes)
    check_device(args)  # after the flags' own checks: this one imports torch
    return config


def _read_images(paths: list[str]) -> list:
    """`run --image` files decoded (one line naming the file for one that is missing or not an image)."""
    from edgeserve.vision.images import ImageError, decode_image

    out = []
    for p in paths:
        try:
            out.append(decode_image(Path(p).expanduser().read_bytes(), p))
        except (OSError, ImageError) as e:
            raise EdgeserveError(f"--image {p}: {e}") from None
    return out


def start_native_build(device: str, cpu_moe_layers: object, say_it: bool = True) -> threading.Thread:
    """Where the native CPU kernels will run (a CPU device, or MoE experts kept on the host), compile them now in a
    thread, with a progress line on stderr (`say_it`), rather than silently inside the first request or load (which
    waits for the build if it comes first). Returns the thread (already finished where there is nothing to do)."""
    from edgeserve.device import resolve_device

    def say(message: str) -> None:
        if say_it:
            print(f"edgeserve: {message}", file=sys.stderr, flush=True)

    def work() -> None:
        if resolve_device(device).type == "cpu" or cpu_moe_layers is not None:
            from edgeserve.kernels.cpu import native as cpu_native

            cpu_native.prebuild(say)

    thread = threading.Thread(target=work, name="native-kernel-build", daemon=True)
    thread.start()
    return thread


def cmd_serve(args: argparse.Namespace) -> int:
    from edgeserve.serve_checks import check_adapters, check_models, check_port

    config = server_config_from_args(args)
    models = config.models
    check_port(config.host, config.port)  # one line and status 1, before anything is pulled or said
    check_models(models, allow_pull=config.allow_pull, load_format=config.load_format)  # pulls what is missing
    check_adapters(config.engine.loras)

    import uvicorn

    from edgeserve.server import create_app
    from edgeserve.server.state import configure_logging
    configure_logging(args.log_level)
    print(f"edgeserve: serving {', '.join(models)} on http://{args.host}:{args.port} "
          f"(OpenAI API at /v1, Ollama API at /api, chat page at /); models load on first request",
          file=sys.stderr, flush=True)
    start_native_build(config.device, config.cpu_moe_layers)  # in the background: the server answers meanwhile
    from edgeserve.server.kv_plan import planned_kv_line

    for spec in models:  # the memory each text model's KV pool will take, and why
        line = planned_kv_line(spec, config)
        if line:
            print(f"edgeserve: {line}", file=sys.stderr, flush=True)
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    return 0


def cmd_cluster(args: argparse.Namespace) -> int:
    from edgeserve.cluster.launch import ClusterConfig, require_ray
    from edgeserve.serve_checks import check_models, check_port

    config = server_config_from_args(args)
    cluster = ClusterConfig(address=args.address, replicas=args.replicas, num_cpus=args.num_cpus,
                            num_gpus=args.num_gpus, routing=args.routing, max_imbalance=args.max_imbalance)
    require_ray()  # the install hint before anything is pulled or started
    check_port(config.host, config.port)
    check_models(config.models, allow_pull=config.allow_pull, load_format=config.load_format)

    import uvicorn

    from edgeserve.cluster import launch
    from edgeserve.server.state import configure_logging

    configure_logging(args.log_level)
    where = f"the Ray cluster at {args.address}" if args.address else "a Ray instance on this machine"
    print(f"edgeserve: starting {cluster.replicas} replicas of {', '.join(config.models)} on {where}",
          file=sys.stderr, flush=True)
    deployed = launch.start(config, cluster)
    try:
        print(f"edgeserve: serving on http://{args.host}:{args.port} ({cluster.routing} routing; OpenAI API at /v1, "
              f"Ollama API at /api, chat page at /); models load on first request", file=sys.stderr, flush=True)
        uvicorn.run(deployed.ingress, host=args.host, port=args.port, log_level="warning",
                    timeout_graceful_shutdown=5)
    finally:
        launch.stop(deployed)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from edgeserve.bench.command import run_bench

    return run_bench(args)


COMMANDS = {"pull": cmd_pull, "list": cmd_list, "rm": cmd_rm, "run": cmd_run, "serve": cmd_serve, "cluster": cmd_cluster,
            "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `edgeserve` console script; errors become one line and exit status 1."""
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # bare `edgeserve`: the usage and what to type, as argparse
        parser.print_usage(sys.stderr)
        print("edgeserve: error: a command is required; `edgeserve --help` lists them", file=sys.stderr)
        return 2
    one_line_parse_errors("edgeserve", parser, *parser.subcommand_parsers)  # type: ignore[attr-defined]
    args, extra = parser.parse_known_args(argv)
    if args.command == "run":  # flags may sit between MODEL and PROMPT: the words after them are positionals too
        args.args += [a for a in extra if not a.startswith("-")]
        extra = [a for a in extra if a.startswith("-")]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return run_reporting_errors("edgeserve", lambda: COMMANDS[args.command](args))

if __name__ == "__main__":
    sys.exit(main())
