"""The inference engine: EngineCore (core), AsyncEngine (async_engine), EngineConfig (config), what it hands back
(outputs) and the step-and-deliver loop (delivery), over four wings: cache/ (what each layer keeps, the paged KV pool,
prefix cache, recurrent-state slots), sched/ (requests and which run each step), runner/ (one step through the
model, sampling, adapters, the embedding engine) and spec/ (speculative decoding)."""
