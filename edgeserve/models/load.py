"""Load a resolved model source into a ready model, tokenizer and chat template."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from edgeserve.loaders.chat_template import ChatTemplate, chat_template_from_gguf, chat_template_from_hf_folder
from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.loaders.gguf_weights import GGUFWeights
from edgeserve.loaders.hf_folder import HFFolder
from edgeserve.loaders.tokenizer import Tokenizer, tokenizer_from_gguf, tokenizer_from_hf_folder
from edgeserve.errors import ModelLoadError
from edgeserve.memory import release_large_frees_to_os
from edgeserve.registry.resolve import ModelSource

from .config import ModelConfig, config_from_gguf, config_from_hf
from .llama import LlamaModel

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


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the device computes it fast (CPUs with torch's int4/bf16 kernels, CUDA sm_80+), else fp16."""
    from edgeserve.device import auto_dtype

    return auto_dtype(device)


def load_model(source: ModelSource, dtype: str = "auto", device: str = "cpu", load_format: str = "auto") -> LoadedModel:
    """Read config, tokenizer, template and weights (layer by layer) from a GGUF file or HF folder.

    `device`: "auto" (CUDA when available, else CPU), "cpu", "cuda", "cuda:N" (a bad one raises DeviceError).
    `load_format="dummy"`: random weights of the shape a config.json (a file or a folder's) describes.
    """
    from edgeserve.device import resolve_device, resolve_dtype

    start = time.perf_counter()
    release_large_frees_to_os()
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"load format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    if load_format == "dummy":
        return _load_dummy(source, torch_dtype, dev, start)
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
    model = LlamaModel.from_weights(config, weights, dtype=torch_dtype, device=dev)
    return LoadedModel(source.name, source, config, model, tokenizer, template, time.perf_counter() - start)


def _load_dummy(source: ModelSource, dtype: torch.dtype, device: torch.device, start: float) -> LoadedModel:
    """Random weights (drawn on the device) for a config.json's shape; 4-bit when its quantization_config says so."""
    from .dummy import DummyWeights, dummy_chat_template, dummy_tokenizer, int4_group_size, read_config_json

    cfg = read_config_json(source.path)
    config = config_from_hf(cfg)
    weights = DummyWeights(config, device, dtype, int4_group=int4_group_size(cfg))
    model = LlamaModel.from_weights(config, weights, dtype=dtype, device=device)
    return LoadedModel(source.name, source, config, model, dummy_tokenizer(config.vocab_size), dummy_chat_template(),
                       time.perf_counter() - start)
