"""Probe and timing workload of the dense linear op (see kernels/probes/checks.py, kernels/probes/timing.py).

The probe runs a candidate on the model's own projection shapes (cut to at most ``MAX_ROWS`` output rows:
accuracy depends on the summed length K, not on N) and a few odd ones, at decode and prefill row counts,
with and without a bias, against ``F.linear`` in float32 on the host.

The timing workload is a decode step's linear layers with their weights COLD, as in a real step (the K/V
stream and the other layers evict them between steps): the model's projection shapes at ``DECODE_SEQS``
rows, cycled over enough copies to overflow the last-level cache. With hot weights a BLAS GEMM and a
streaming kernel rank differently; only the cold ranking matches the step.
"""

from collections.abc import Callable

import torch

from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.probes.inputs import ProbeInputs, max_error, to_host32

MAX_ROWS = 320
PROBE_TOKENS = (1, 3, 8, 16, 17, 33)  # decode batches, and past the C++ kernel's row limit
ODD_SHAPES = ((13, 37), (5, 300))  # K not a multiple of the vector width, N not of the block
COLD_BYTES = 96 << 20  # the copies cycled over: beyond a shared L3 of 32 MB and more
MAX_WEIGHT_BYTES = 16 << 20  # one copy of one weight at most (a big model's lm_head is gigabytes)
DECODE_SEQS = 8


def projection_shapes(shapes: ModelShapes) -> list[tuple[int, int]]:
    """(out, in) of the model's dense linear layers: fused q/k/v, o_proj, fused gate/up, down_proj, lm_head."""
    q, kv = shapes.num_heads * shapes.head_dim, shapes.num_kv_heads * shapes.head_dim
    hidden, inter = shapes.hidden_size, shapes.intermediate_size
    return [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter), (shapes.vocab_size, hidden)]


def probe_linear(fn: dict[str, Callable], shapes: ModelShapes, x: ProbeInputs) -> float:
    errors = []
    for n_out, k in [*projection_shapes(shapes), *ODD_SHAPES]:
        # weights scaled so that each output is of order one, as the tolerances assume
        weight = x.randn(min(n_out, MAX_ROWS), k) * k**-0.5
        bias = x.randn(weight.shape[0])
        for tokens in PROBE_TOKENS:
            hidden = x.randn(tokens, k)
            for b in (None, bias):
                want = torch.nn.functional.linear(*map(to_host32, (hidden, weight, b)))
                errors.append(max_error(fn["linear"](hidden, weight, b), want))
    return max(errors)


def linear_workload(fn: dict[str, Callable], shapes: ModelShapes, device: torch.device,
                    dtype: torch.dtype) -> Callable[[], object]:
    itemsize = torch.empty((), dtype=dtype).element_size()
    weights = []
    for n_out, k in projection_shapes(shapes):
        rows = max(1, min(n_out, MAX_WEIGHT_BYTES // (k * itemsize)))
        weights.append(torch.full((rows, k), 0.01, dtype=dtype, device=device))  # every page written
    layer_bytes = sum(w.nbytes for w in weights)
    copies = max(1, -(-COLD_BYTES // layer_bytes))
    cycle = [w.clone() for _ in range(copies) for w in weights]
    inputs = {w.shape[1]: torch.randn(DECODE_SEQS, w.shape[1], dtype=dtype, device=device) for w in weights}
    linear = fn["linear"]

    def run() -> None:
        for w in cycle:
            linear(inputs[w.shape[1]], w)

    return run


PROBES = {"linear": probe_linear}
WORKLOADS = {"linear": linear_workload}
