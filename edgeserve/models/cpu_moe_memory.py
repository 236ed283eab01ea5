"""Bytes of the experts that --cpu-moe-layers keeps in host memory, for the fit check before a load (the server's
507): they count against host memory, not the device's."""

from __future__ import annotations

import torch

from edgeserve.registry.resolve import ModelSource

from .config import ModelConfig, config_from_gguf, config_from_hf
from .cpu_moe import CpuMoeLayers, host_expert_layers


def source_config(source: ModelSource, load_format: str = "auto") -> ModelConfig:
    """The ModelConfig of a source without loading its weights (a GGUF's metadata, a config.json)."""
    if load_format == "dummy":
        from .dummy import read_config_json

        return config_from_hf(read_config_json(source.path))
    if source.kind == "gguf":
        from edgeserve.loaders.gguf_file import GGUFFile

        gguf = GGUFFile(source.path)
        return config_from_gguf(gguf.metadata, set(gguf.tensor_names()))
    from edgeserve.loaders.hf_folder import HFFolder

    return config_from_hf(HFFolder(source.path).config)


def host_expert_bytes(source: ModelSource, cpu_moe_layers: CpuMoeLayers, dtype: torch.dtype,
                      load_format: str = "auto") -> int:
    """Bytes of the routed experts of the first `cpu_moe_layers` MoE layers of `source`: a GGUF's 3-D expert
    tensors of those layers as stored (they stay in block format), else the experts dense in `dtype` (an HF
    folder's or random weights, dense on the host). Raises EdgeserveError as load_model would for a bad count."""
    if cpu_moe_layers is None:
        return 0
    config = source_config(source, load_format)
    layers = host_expert_layers(cpu_moe_layers, config)
    if layers == 0:
        return 0
    if source.kind == "gguf" and load_format != "dummy":
        from edgeserve.loaders.gguf_file import GGUFFile

        gguf = GGUFFile(source.path)
        prefixes = tuple(f"blk.{i}." for i in range(layers))
        infos = (gguf.tensor_info(n) for n in gguf.tensor_names() if n.startswith(prefixes))
        return sum(info.n_bytes for info in infos if len(info.shape) == 3)
    per_layer = config.num_experts * 3 * config.moe_intermediate_size * config.hidden_size
    return layers * per_layer * torch.empty((), dtype=dtype).element_size()
