"""CPU kernels: C++ built on first use (csrc/), the batched SDPA prefill, huge-page allocations."""
