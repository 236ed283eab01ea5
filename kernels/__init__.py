"""Compute kernels: Triton implementations and their torch reference twins."""
