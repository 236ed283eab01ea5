"""The engine's runner wing: one scheduled step through the model (the persistent input batch, CUDA-graph decode,
LoRA adapters, batched sampling) and the embedding engine that runs encoder batches. It imports the cache and
scheduling wings, never speculation."""
