"""Load a resolved model source into a ready model, tokenizer and chat template."""

from __future__ import annotations

import logging
import time
from typing import Any
from dataclasses import dataclass
from pathlib import Path

import torch

from edgeserve.loaders.chat_template import ChatTemplate, chat_template_from_gguf, chat_template_from_hf_folder
from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.loaders.gguf_weights import GGUFWeights
from edgeserve.errors import EdgeserveError
from edgeserve.loaders.hf_folder import HFFolder
from edgeserve.loaders.quantize import Int4QuantizingWeights
from edgeserve.loaders.tokenizer import Tokenizer, tokenizer_from_gguf, tokenizer_from_hf_folder
from edgeserve.errors import ModelLoadError
from edgeserve.memory import load_allocations, release_large_frees_to_os
from edgeserve.registry.resolve import ModelSource

from .config import ModelConfig, config_from_gguf, config_from_hf
from .cpu_moe import CpuMoeLayers, applies_to, host_expert_layers, host_experts, moe_layer_count
from .decoders import decoder_class, dummy_decoder_class
from .llama import LlamaModel
from .load_config import LoadConfig

log = logging.getLogger(__name__)

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A model ready to run: weights on the device plus its tokenizer and chat template."""

    name: str
    source: ModelSource
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    load_seconds: float
    vision: Any = None  # edgeserve.vision.runtime.VisionRuntime of a model that takes images (load_runtime)


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the device computes it fast (CPUs with torch's int4/bf16 kernels, CUDA sm_80+), else fp16."""
    from edgeserve.device import auto_dtype

    return auto_dtype(device)


DENSE_PREFILL = ("auto", "on", "off")
DENSE_PREFILL_RAM_FRACTION = 0.25


def dense_prefill_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the dequantized copies of the decoder's matrices (what `dense_prefill` adds)."""
    c = config
    mlp = 0 if c.is_moe else 3 * c.hidden_size * c.intermediate_size  # experts get no dense copy
    per_layer = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size + mlp
    return c.num_layers * per_layer * torch.empty((), dtype=dtype).element_size()


def want_dense_prefill(setting: str, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether to keep dense copies of CPU int4 weights for prompt tokens: "on", "off", or "auto" (on a CPU when
    the copies take at most a quarter of the memory available now)."""
    if setting not in DENSE_PREFILL:
        raise ValueError(f"dense_prefill must be one of {', '.join(DENSE_PREFILL)}, not {setting!r}")
    if setting != "auto" or device.type != "cpu":
        return setting == "on"
    import psutil

    return dense_prefill_bytes(config, dtype) <= DENSE_PREFILL_RAM_FRACTION * psutil.virtual_memory().available


@load_allocations()  # large frees back to the OS while loading; step buffers reused after
def load_model(source: ModelSource, load: LoadConfig | None = None, **options: Any) -> LoadedModel:
    """Read config, tokenizer, template and weights (layer by layer) from a GGUF file or HF folder, as `load` (a
    LoadConfig; or its fields as keyword `options`) says."""
    from edgeserve.device import resolve_device

    from .dtype_policy import choose_dtype

    if load is not None and options:
        raise ValueError("pass either a LoadConfig or its fields, not both")
    load = load or LoadConfig(**options)
    start = time.perf_counter()
    load.check()
    dev = resolve_device(load.device)
    choice = choose_dtype(load.dtype, dev, source, load.load_format, load.quantize)
    log.info("%s: %s", source.name, choice.describe())
    torch_dtype = choice.dtype
    if load.load_format == "dummy":
        return _load_dummy(source, load, torch_dtype, dev, start)
    if source.path.is_file() and source.path.suffix.lower() == ".json":
        raise ModelLoadError(f"{source.path} is a config file without weights; add --load-format dummy for "
                             "random weights of its shape")
    if source.kind == "gguf":
        gguf = GGUFFile(source.path)
        config = config_from_gguf(gguf.metadata, set(gguf.tensor_names()))
        tokenizer = tokenizer_from_gguf(gguf.metadata)
        template = chat_template_from_gguf(gguf.metadata)
        weights = GGUFWeights(gguf, config.num_heads, config.num_kv_heads)
    else:
        folder = HFFolder(source.path)
        config = config_from_hf(folder.config)
        tokenizer = tokenizer_from_hf_folder(source.path)
        template = chat_template_from_hf_folder(source.path)
        weights = folder.weights()
    if load.quantize is not None:
        weights = _quantizing(weights, source, config, tokenizer, torch_dtype, dev, load.quantize_group_size,
                              load.quantize_calibration)
    with host_experts(_host_expert_layers(load.cpu_moe_layers, config, dev)):
        model = decoder_class(config).from_weights(config, weights, dtype=torch_dtype, device=dev,
                                                   dense_prefill=want_dense_prefill(load.dense_prefill, config,
                                                                                    torch_dtype, dev))
    return LoadedModel(source.name, source, config, model, tokenizer, template, time.perf_counter() - start)


def _host_expert_layers(cpu_moe_layers: CpuMoeLayers, config: ModelConfig, device: torch.device) -> int:
    """How many MoE layers load with their experts on the host (checked against the model; 0 on a CPU)."""
    n = host_expert_layers(cpu_moe_layers, config)
    if n and not applies_to(device):
        log.info("--cpu-moe-layers changes nothing on a CPU run: every weight is in host memory already")
        return 0
    if n:
        log.info("experts of %d of %d MoE layers stay in host memory on the CPU kernels", n, moe_layer_count(config))
    return n


def _quantizing(weights, source: ModelSource, config: ModelConfig, tokenizer: Tokenizer, dtype: torch.dtype,
                device: torch.device, group_size: int, calibration: str | None):
    """`weights` wrapped to quantize to INT4 on load (after AWQ-style calibration), or as they are if stored
    quantized already."""
    stored = weights.stored_quantized()
    if stored:
        log.warning("%s is already quantized (%s); --quantize int4 applies to float weights, loading it as stored",
                    source.name, ", ".join(stored))
        return weights
    scales = None
    if calibration is not None:
        from .calibrate import awq_scales

        try:
            text = Path(calibration).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise EdgeserveError(f"cannot read the calibration text {calibration}: {e}") from None
        scales = awq_scales(config, weights, tokenizer.encode(text), group_size, dtype, device)
        release_large_frees_to_os()
    return Int4QuantizingWeights(weights, group_size, scales)


def _load_dummy(source: ModelSource, load: LoadConfig, dtype: torch.dtype, device: torch.device,
                start: float) -> LoadedModel:
    """Random weights (drawn on the device) for a config.json's shape; 4-bit when its quantization_config says so
    or `load.quantize` asks for it."""
    from .dummy import DummyWeights, dummy_chat_template, dummy_tokenizer, int4_group_size, read_config_json

    cfg = read_config_json(source.path)
    config = config_from_hf(cfg)
    decoder = dummy_decoder_class(config)  # DummyWeights has Llama names (and MoE experts), and gpt-oss's own
    int4_group = load.quantize_group_size if load.quantize else None
    weights = DummyWeights(config, device, dtype, int4_group=int4_group_size(cfg) or int4_group)
    with host_experts(_host_expert_layers(load.cpu_moe_layers, config, device)):
        model = decoder.from_weights(config, weights, dtype=dtype, device=device,
                                     dense_prefill=want_dense_prefill(load.dense_prefill, config, dtype, device))
    return LoadedModel(source.name, source, config, model, dummy_tokenizer(config.vocab_size), dummy_chat_template(),
                       time.perf_counter() - start)
