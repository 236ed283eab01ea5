"""Compute kernels by backend: torch/ (the reference twins), triton/ (CUDA), cpu/ (the native C kernels and their
bindings), formats/ (weight and KV formats); dispatch picks one per call. Nothing here names a model."""
