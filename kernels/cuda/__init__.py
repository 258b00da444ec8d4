"""Kernels for NVIDIA GPUs beyond the portable Triton ones."""
