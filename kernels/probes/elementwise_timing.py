"""Timing workloads of the per-layer elementwise ops and the sampler's filter (kernels/probes/timing.py):
one decode step's calls at the model's shapes, so a fused kernel is weighed against the reference where
the step spends its time. Each op runs once per layer (``LAYERS`` calls: one call alone is mostly launch
latency and timer noise); top-k / top-p once per step, over the whole vocabulary."""

from collections.abc import Callable

import torch

from xinserve.kernels.model_shapes import ModelShapes

LAYERS = 16
DECODE_TOKENS = 32  # a busy decode batch: one token per sequence


def _randn(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device=device)


def rms_norm_workload(fn: dict[str, Callable], shapes: ModelShapes, device: torch.device,
                      dtype: torch.dtype) -> Callable[[], object]:
    hidden, residual = (_randn(DECODE_TOKENS, shapes.hidden_size, dtype=dtype, device=device) for _ in range(2))
    weight = torch.ones(shapes.hidden_size, dtype=dtype, device=device)
    norm, eps = fn["rms_norm"], shapes.rms_norm_eps

    def run() -> None:
        for _ in range(LAYERS):  # the post-attention norm with its residual add
            norm(hidden, weight, eps, residual)

    return run


def rotary_workload(fn: dict[str, Callable], shapes: ModelShapes, device: torch.device,
                    dtype: torch.dtype) -> Callable[[], object]:
    # query and key as the model has them: slices of the fused qkv projection
    q_size, kv_size = shapes.num_heads * shapes.head_dim, shapes.num_kv_heads * shapes.head_dim
    qkv = _randn(DECODE_TOKENS, q_size + 2 * kv_size, dtype=dtype, device=device)
    query = qkv[:, :q_size].view(DECODE_TOKENS, shapes.num_heads, shapes.head_dim)
    key = qkv[:, q_size : q_size + kv_size].view(DECODE_TOKENS, shapes.num_kv_heads, shapes.head_dim)
    positions = torch.arange(DECODE_TOKENS, device=device) * 7
    cache = _randn(8 * DECODE_TOKENS, shapes.rotary_dim, dtype=torch.float32, device=device)
    table = fn["rotary_cos_sin"](positions, cache, shapes.rope_is_neox, dtype)  # once per step
    rotate, is_neox = fn["rotary_embedding"], shapes.rope_is_neox

    def run() -> None:
        for _ in range(LAYERS):
            rotate(query, key, table, is_neox)

    return run


def silu_and_mul_workload(fn: dict[str, Callable], shapes: ModelShapes, device: torch.device,
                          dtype: torch.dtype) -> Callable[[], object]:
    gate_up = _randn(DECODE_TOKENS, 2 * shapes.intermediate_size, dtype=dtype, device=device)
    act = fn["silu_and_mul"]

    def run() -> None:
        for _ in range(LAYERS):
            act(gate_up)

    return run


def top_k_top_p_workload(fn: dict[str, Callable], shapes: ModelShapes, device: torch.device,
                         dtype: torch.dtype) -> Callable[[], object]:
    # logits are float32 in the sampler whatever the model's dtype; mixed settings, as a batch has them
    logits = 3 * _randn(DECODE_TOKENS, shapes.vocab_size, dtype=torch.float32, device=device)
    rows = torch.arange(DECODE_TOKENS, device=device)[:, None]
    top_k = torch.where(rows % 2 == 0, min(50, shapes.vocab_size), 0).to(torch.int64)
    top_p = torch.where(rows % 3 == 0, 1.0, 0.9).to(torch.float32)
    return lambda: fn["top_k_top_p"](logits, top_k, top_p)


WORKLOADS = {"rms_norm": rms_norm_workload, "rotary": rotary_workload, "silu_and_mul": silu_and_mul_workload,
             "top_k_top_p": top_k_top_p_workload}
