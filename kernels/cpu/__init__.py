"""Native CPU kernels: the C sources (src/, include/), their ctypes bindings and the fused decoder stack."""
