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
from edgeserve.memory import release_large_frees_to_os
from edgeserve.registry.resolve import ModelSource

from .config import ModelConfig, config_from_gguf, config_from_hf
from .llama import LlamaModel

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


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the device computes it fast (CPUs with torch's int4/bf16 kernels, recent GPUs), else fp16/fp32."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16


def load_model(source: ModelSource, dtype: str = "auto", device: str = "cpu") -> LoadedModel:
    """Read config, tokenizer, template and weights (layer by layer) from a GGUF file or HF folder."""
    start = time.perf_counter()
    release_large_frees_to_os()
    dev = torch.device(device)
    torch_dtype = DTYPES[dtype] or default_dtype(dev)
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
