"""Triton kernels (CUDA), each the twin of a torch reference op with the same signature."""
