"""LoRA adapters: PEFT folders and llama.cpp GGUF LoRA files read into float32 low-rank pairs per fused weight.

An adapter changes a projection W [out, in] to y = xW^T + s (x A^T) B^T with A [r, in], B [out, r] and s its scale
(lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA). The decoder fuses q/k/v into `qkv` and gate/up into `gate_up`,
so the pairs of a fused weight's parts are stacked here into one: A of every part one above the other ([sum r, in])
and each part's B transposed with its scale folded in ([r_p, out_p] at its rows of A and its output columns), so that
one pair per fused weight serves the per-op torch path and the native stack (kernels/cpu/src/lora.c) alike.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from edgeserve.errors import InvalidRequestError, ModelLoadError

from .config import ModelConfig

# the decoder's fused weights and the HF projections stacked in each (in the decoder's row order)
TARGETS: dict[str, tuple[str, ...]] = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
TARGET_INDEX = {name: i for i, name in enumerate(TARGETS)}  # layer.c's order of the four targets
_PROJECTION = {p: t for t, parts in TARGETS.items() for p in parts}


class AdapterError(InvalidRequestError):
    """An adapter that cannot apply to this base model (missing file, wrong shapes, another architecture, an
    unsupported kind of adapter): one clear sentence (HTTP 400)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "lora")


@dataclass
class LoraPart:
    """One stacked part's B: rows r0.. of the fused A feed its output columns c0.. through bt [r, n] (B transposed,
    the scale folded in)."""

    r0: int
    c0: int
    bt: torch.Tensor


@dataclass
class LoraPair:
    """One fused weight's low-rank update: out[:, part] += (x @ a.T)[:, part rows] @ part.bt for each part; a
    [R, in]; float32, or bfloat16 beside a bfloat16 model (contiguous)."""

    a: torch.Tensor
    parts: list[LoraPart]


@dataclass(eq=False)
class LoraAdapter:
    """A loaded adapter: its pairs by layer and fused weight, and a digest of its content (files' bytes), which
    keys the prefix cache so that a name reloaded with new weights never reuses old KV."""

    name: str
    path: Path
    digest: bytes
    rank: int
    layers: list[dict[str, LoraPair]]
    dtype: torch.dtype = torch.float32  # of every tensor of its pairs
    device: torch.device = torch.device("cpu")
    int8: bool = False  # the native CPU stack reads an int8 copy (a scale per rank row) rather than these pairs
    native: object = field(default=None, repr=False)  # kernels.cpu.lora's tables, built on first use

    def prefix_root(self, scale: float) -> bytes:
        """The prefix-cache chain root of a request running this adapter at `scale` (engine.cache.prefix_key)."""
        kind = b"int8\0" if self.int8 else b""  # the int8 copy computes slightly other values: other KV
        return hashlib.sha256(b"lora\0" + kind + self.digest + struct.pack("<d", float(scale))).digest()

    def to(self, device: torch.device | str, dtype: torch.dtype = torch.float32) -> "LoraAdapter":
        """Move the pairs to `device` (the base model's: a GPU step adds them there) as `dtype` (bfloat16 halves
        what a step reads beside a bfloat16 model), in place; returns self."""
        for layer in self.layers:
            for p in layer.values():
                p.a = p.a.to(device, dtype).contiguous()
                for part in p.parts:
                    part.bt = part.bt.to(device, dtype).contiguous()
        self.native, self.dtype, self.device = None, dtype, torch.device(device)
        return self


def load_adapter(name: str, path: str | Path, config: ModelConfig) -> LoraAdapter:
    """The adapter at `path` (a PEFT folder with adapter_config.json, or a GGUF LoRA file), checked against the
    base model's `config`; raises AdapterError with what is wrong."""
    path = Path(path).expanduser()
    try:
        if not path.exists():
            raise AdapterError(f"adapter {name!r}: {path} does not exist")
        if path.is_dir():
            pairs, digest = _read_peft(path, config)
        elif path.suffix == ".gguf" or _magic(path) == b"GGUF":
            pairs, digest = _read_gguf(path, config)
        else:
            pairs = None
    except OSError as e:  # a name too long, a folder without permission, a file gone while it was read
        raise AdapterError(f"adapter {name!r}: {str(path)[:200]} cannot be read ({e.strerror or e})") from None
    if pairs is None:
        raise AdapterError(f"adapter {name!r}: {path} is neither a PEFT folder (adapter_config.json + "
                           "adapter_model.safetensors) nor a GGUF LoRA file")
    if not pairs:
        raise AdapterError(f"adapter {name!r}: {path} holds no LoRA weights for the attention or MLP projections")
    layers = _fuse(name, pairs, config)
    rank = max(a.shape[0] for a, _, _ in pairs.values())
    return LoraAdapter(name, path, digest, rank, layers)


def _magic(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(4)


# (layer, HF projection) -> (A [r, in], B [out, r], scale)
_Pairs = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]
_LAYER_RE = re.compile(r"(?:.*\.)?layers\.(\d+)\.((?:self_attn|mlp)\.\w+_proj)\.lora_([AB])(?:\.\w+)?\.weight")


def _read_peft(folder: Path, config: ModelConfig) -> tuple[_Pairs, bytes]:
    cfg_path, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for p in (cfg_path, weights):
        if not p.is_file():
            raise AdapterError(f"PEFT adapter {folder}: {p.name} is missing")
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise AdapterError(f"PEFT adapter {folder}: adapter_config.json is not JSON ({e})") from None
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"PEFT adapter {folder}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora"):
        raise AdapterError(f"PEFT adapter {folder}: DoRA adapters are not supported")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"PEFT adapter {folder}: modules_to_save ({cfg['modules_to_save']}) are full weights, "
                           "not LoRA; merge that adapter instead")
    if cfg.get("fan_in_fan_out"):
        raise AdapterError(f"PEFT adapter {folder}: fan_in_fan_out (Conv1D bases) is not a Llama-family layout")
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(weights))
    except Exception as e:  # noqa: BLE001 - safetensors raises several kinds for a damaged file
        raise AdapterError(f"PEFT adapter {folder}: cannot read adapter_model.safetensors ({e})") from None
    alpha, rs = float(cfg.get("lora_alpha", cfg.get("r", 8))), bool(cfg.get("use_rslora"))
    patterns = cfg.get("alpha_pattern") or {}
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        m = _LAYER_RE.fullmatch(key)
        if m is None or m[2] not in _PROJECTION:
            raise AdapterError(f"PEFT adapter {folder}: tensor {key!r} is not a LoRA A/B of an attention or MLP "
                               "projection (embeddings, lm_head and biases are not supported)")
        found.setdefault((int(m[1]), m[2]), {})[m[3]] = value
    pairs: _Pairs = {}
    for (i, proj), ab in found.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"PEFT adapter {folder}: layer {i} {proj} has lora_{''.join(ab)} without its pair")
        r = ab["A"].shape[0]
        a_ = next((float(v) for k, v in patterns.items() if f"layers.{i}.{proj}".endswith(k) or proj.endswith(k)),
                  alpha)
        pairs[i, proj] = (ab["A"].float(), ab["B"].float(), a_ / (math.sqrt(r) if rs else r))
    digest = hashlib.sha256(cfg_path.read_bytes() + weights.read_bytes()).digest()
    return pairs, digest


def _read_gguf(path: Path, config: ModelConfig) -> tuple[_Pairs, bytes]:
    from edgeserve.loaders.gguf_file import GGUFFile
    from edgeserve.loaders.gguf_weights import gguf_name, permuted_qk
    from edgeserve.loaders.weights import unpermute_qk

    try:
        f = GGUFFile(path)
    except (ModelLoadError, ValueError, OSError) as e:
        raise AdapterError(f"GGUF adapter {path}: {e}") from None
    meta = f.metadata
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise AdapterError(f"GGUF adapter {path}: not a LoRA adapter (general.type {meta.get('general.type')!r}, "
                           f"adapter.type {meta.get('adapter.type')!r})")
    arch = meta.get("general.architecture")
    if arch != config.architecture:
        raise AdapterError(f"GGUF adapter {path}: made for a {arch!r} model, the base model is "
                           f"{config.architecture!r}")
    alpha = float(meta.get("adapter.lora.alpha", 0.0))
    names = set(f.tensor_names())
    by_gguf = {gguf_name(f"model.layers.{i}.{p}.weight", arch): (i, p)
               for i in range(config.num_layers) for p in _PROJECTION}
    pairs: _Pairs = {}
    for n in names:
        if not n.endswith((".lora_a", ".lora_b")):
            raise AdapterError(f"GGUF adapter {path}: tensor {n!r} is not a LoRA A/B")
        base = n[: -len(".lora_a")]
        if base not in by_gguf:
            raise AdapterError(f"GGUF adapter {path}: {base!r} is not an attention or MLP projection of this "
                               f"{config.num_layers}-layer base")
        if n.endswith(".lora_b"):
            continue
        if base + ".lora_b" not in names:
            raise AdapterError(f"GGUF adapter {path}: {n!r} has no lora_b")
        i, proj = by_gguf[base]
        a, b = f.load_tensor(n, torch.float32), f.load_tensor(base + ".lora_b", torch.float32)
        if permuted_qk(arch) and proj in ("self_attn.q_proj", "self_attn.k_proj"):
            b = unpermute_qk(b, config.num_heads if proj.startswith("self_attn.q") else config.num_kv_heads)
        r = a.shape[0]
        pairs[i, proj] = (a.clone(), b.clone(), alpha / r if alpha else 1.0)
    return pairs, hashlib.sha256(path.read_bytes()).digest()


def _shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each HF projection of the base."""
    c, f = config, config.intermediate_size
    return {"self_attn.q_proj": (c.q_size, c.hidden_size), "self_attn.k_proj": (c.kv_size, c.hidden_size),
            "self_attn.v_proj": (c.kv_size, c.hidden_size), "self_attn.o_proj": (c.hidden_size, c.q_size),
            "mlp.gate_proj": (f, c.hidden_size), "mlp.up_proj": (f, c.hidden_size),
            "mlp.down_proj": (c.hidden_size, f)}


def _fuse(name: str, pairs: _Pairs, config: ModelConfig) -> list[dict[str, LoraPair]]:
    """The pairs stacked per fused weight, checked against the base's shapes."""
    shapes = _shapes(config)
    layers: list[dict[str, LoraPair]] = [{} for _ in range(config.num_layers)]
    for (i, proj), (a, b, _) in pairs.items():
        out, inp = shapes[proj]
        if i >= config.num_layers:
            raise AdapterError(f"adapter {name!r}: layer {i} is past the base model's {config.num_layers} layers")
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != inp or b.shape[0] != out or a.shape[0] != b.shape[1]:
            raise AdapterError(f"adapter {name!r}: layer {i} {proj}: A {tuple(a.shape)} and B {tuple(b.shape)} do "
                               f"not fit the base's {out}x{inp} weight (an adapter for another base model?)")
    for i in range(config.num_layers):
        for target, parts in TARGETS.items():
            present = [p for p in parts if (i, p) in pairs]
            if not present:
                continue
            outs = [shapes[p][0] for p in parts]
            a, stacked, r0 = [], [], 0
            for j, p in enumerate(parts):
                if (i, p) not in pairs:
                    continue
                pa, pb, scale = pairs[i, p]
                a.append(pa)
                stacked.append(LoraPart(r0, sum(outs[:j]), (pb * scale).t().contiguous()))
                r0 += pa.shape[0]
            layers[i][target] = LoraPair(torch.cat(a).contiguous(), stacked)
    return layers

