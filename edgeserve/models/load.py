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
from edgeserve.loaders.quantize import DEFAULT_GROUP_SIZE, Int4QuantizingWeights, check_quantize_options
from edgeserve.loaders.tokenizer import Tokenizer, tokenizer_from_gguf, tokenizer_from_hf_folder
from edgeserve.errors import ModelLoadError
from edgeserve.memory import load_allocations, release_large_frees_to_os
from edgeserve.registry.resolve import ModelSource

from .config import ModelConfig, config_from_gguf, config_from_hf
from .cpu_moe import CpuMoeLayers, applies_to, host_expert_layers, host_experts, moe_layer_count, parse_cpu_moe_layers
from .decoders import decoder_class, dummy_decoder_class
from .llama import LlamaModel

log = logging.getLogger(__name__)

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOAD_FORMATS = ("auto", "dummy")


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
def load_model(source: ModelSource, dtype: str = "auto", device: str = "cpu", load_format: str = "auto",
               quantize: str | None = None, quantize_group_size: int = DEFAULT_GROUP_SIZE,
               quantize_calibration: str | None = None, dense_prefill: str = "auto",
               cpu_moe_layers: CpuMoeLayers = None) -> LoadedModel:
    """Read config, tokenizer, template and weights (layer by layer) from a GGUF file or HF folder.

    `device`: "auto" (CUDA when available, else CPU), "cpu", "cuda", "cuda:N" (a bad one raises DeviceError).
    `load_format="dummy"`: random weights of the shape a config.json (a file or a folder's) describes (4-bit with
    `quantize="int4"` or a 4-bit quantization_config).
    `quantize="int4"`: a float model's layer matrices are quantized to group-wise INT4 as they load (groups of
    `quantize_group_size` input columns), after activation-aware scaling from the text file
    `quantize_calibration` when one is given; a model that is already quantized loads as stored, with a warning.
    `dense_prefill` (auto / on / off): see `want_dense_prefill`; it only matters for 4-bit weights on a CPU.
    `cpu_moe_layers` (None, a count, or "all"): the routed experts of that many MoE layers (the first ones) stay in
    host memory on the native CPU kernels while the rest of the model is on `device` (edgeserve.models.cpu_moe);
    a no-op on a CPU; refused for a model without experts or a count over its MoE layers.
    """
    from edgeserve.device import resolve_device, resolve_dtype

    start = time.perf_counter()
    try:
        check_quantize_options(quantize, quantize_group_size)
        parse_cpu_moe_layers(cpu_moe_layers)
    except ValueError as e:
        raise EdgeserveError(str(e)) from None
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"load format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    if load_format == "dummy":
        return _load_dummy(source, torch_dtype, dev, start, quantize_group_size if quantize else None, dense_prefill,
                           cpu_moe_layers)
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
    if quantize is not None:
        weights = _quantizing(weights, source, config, tokenizer, torch_dtype, dev, quantize_group_size,
                              quantize_calibration)
    with host_experts(_host_expert_layers(cpu_moe_layers, config, dev)):
        model = decoder_class(config).from_weights(config, weights, dtype=torch_dtype, device=dev,
                                                   dense_prefill=want_dense_prefill(dense_prefill, config, torch_dtype,
                                                                                    dev))
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


def _load_dummy(source: ModelSource, dtype: torch.dtype, device: torch.device, start: float, int4_group: int | None,
                dense_prefill: str, cpu_moe_layers: CpuMoeLayers = None) -> LoadedModel:
    """Random weights (drawn on the device) for a config.json's shape; 4-bit when its quantization_config says so
    or `int4_group` is given."""
    from .dummy import DummyWeights, dummy_chat_template, dummy_tokenizer, int4_group_size, read_config_json

    cfg = read_config_json(source.path)
    config = config_from_hf(cfg)
    decoder = dummy_decoder_class(config)  # DummyWeights has Llama names (and MoE experts), and gpt-oss's own
    weights = DummyWeights(config, device, dtype, int4_group=int4_group_size(cfg) or int4_group)
    with host_experts(_host_expert_layers(cpu_moe_layers, config, device)):
        model = decoder.from_weights(config, weights, dtype=dtype, device=device,
                                     dense_prefill=want_dense_prefill(dense_prefill, config, dtype, device))
    return LoadedModel(source.name, source, config, model, dummy_tokenizer(config.vocab_size), dummy_chat_template(),
                       time.perf_counter() - start)
