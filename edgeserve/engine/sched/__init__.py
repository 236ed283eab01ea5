"""The engine's scheduling wing: the one per-request state and its registry, the request checks, which sequences
run each step and how many tokens each (chunked prefill, fair admission, prompt pacing, step costs, preemption),
thinking budgets, and each request's detokenization and stop strings. It imports the cache wing, never the runner or
speculation."""
