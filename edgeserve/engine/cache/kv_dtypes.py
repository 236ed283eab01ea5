"""The names `--kv-cache-dtype` takes, torch-free: EngineConfig and the CLI check them, kv_format resolves them."""

KV_CACHE_DTYPES = ("auto", "bf16", "f16", "q8_0", "fp8")
