"""What `serve` says in its first lines about the KV pool each text model will take when it loads, and why: read
from the model's header (GGUF metadata or config.json, no weights) and the memory free now, by the rule the engine
applies at load (engine.cache.kv_budget)."""

from __future__ import annotations

import logging

from edgeserve.engine.cache.kv_budget import GiB, default_cpu_budget, explicit_why, gpu_budget_why
from edgeserve.server.config import ServerConfig

log = logging.getLogger("edgeserve.server")


def header_config(source):
    """A model's ModelConfig from its header alone (GGUF metadata, or an HF folder's / dummy's config.json)."""
    from edgeserve.models.config import config_from_gguf, config_from_hf

    if source.kind == "gguf":
        from edgeserve.loaders.gguf_file import GGUFFile

        gguf = GGUFFile(source.path)
        return config_from_gguf(gguf.metadata, set(gguf.tensor_names()))
    from edgeserve.models.dummy import read_config_json

    return config_from_hf(read_config_json(source.path))


def planned_kv_line(spec: str, config: ServerConfig) -> str | None:
    """"KV cache for NAME: 0.70 GiB, room for 4 requests at the full 8,192-token context ..." for a text model; None
    for an embedding model, or when the header cannot be read (the load will say what is wrong)."""
    try:
        return _planned(spec, config)
    except Exception as e:  # noqa: BLE001 - a startup note, never a reason not to start
        log.debug("no KV plan for %s: %s", spec, e)
        return None


def _planned(spec: str, config: ServerConfig) -> str | None:
    import psutil

    from edgeserve.device import resolve_device
    from edgeserve.models.dtype_policy import choose_dtype
    from edgeserve.engine.cache.kv_cache import kv_bytes_per_token
    from edgeserve.engine.cache.kv_format import resolve_kv_format
    from edgeserve.models.encoders.embedders import is_embedding_source
    from edgeserve.registry import resolve
    from edgeserve.server.model_manager import source_bytes

    source = resolve(spec, pull_missing=False)
    if config.load_format != "dummy" and is_embedding_source(source):
        return None
    engine = config.engine
    head = f"KV cache for {source.name}"
    if engine.kv_cache_gb:
        return f"{head}: {engine.kv_cache_gb:g} GiB ({explicit_why()})"
    dev = resolve_device(config.device)
    if dev.type == "cuda":
        return f"{head}: sized when it loads, {gpu_budget_why(engine.gpu_memory_fraction)}"
    mc = header_config(source)
    context = min(engine.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    free = psutil.virtual_memory().available
    if config.load_format != "dummy":
        free = max(0, free - source_bytes(source))  # what is free once the weights are in
    if mc.is_hybrid:
        return f"{head}: {engine.kv_cache_fraction:.0%} of the memory free when it loads (its recurrent states " \
               "share it); --kv-cache-gb sets it"
    dtype = choose_dtype(config.dtype, dev, source, config.load_format, config.quantize).dtype
    fmt = resolve_kv_format(engine.kv_cache_dtype, mc, dtype, dev)
    plan = default_cpu_budget(kv_bytes_per_token(mc, fmt), context, engine.max_num_seqs, free,
                              engine.kv_cache_fraction)
    return f"{head}: {plan.nbytes / GiB:.2f} GiB ({fmt.name}), {plan.why}"
