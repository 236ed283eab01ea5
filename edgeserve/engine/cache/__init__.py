"""The engine's cache wing: what each layer keeps per sequence (cache_spec), the paged KV pool and its formats,
block tables and the prefix cache, sliding-window blocks, and the recurrent-state slots and snapshots of hybrid
models. It imports nothing of the scheduler, the runner or speculation."""
