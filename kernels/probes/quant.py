"""Probes and timing workloads of the quantized ops (see kernels/probes/checks.py, kernels/probes/timing.py): each
candidate on the worker's device and dtype, on random records of every distinct quantized shape the
model holds (``ModelShapes.quant_shapes``: the stored type, the block grid with its partial edge
blocks, zero points, the activation scheme), against kernels/references/quant.py in float32 on the
host. A matrix is cut to at most ``MAX_SIDE`` rows and columns, keeping its partial last block."""

from collections.abc import Callable

import torch

from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.probes.inputs import ProbeInputs, max_error, to_host32
from xinserve.kernels.quantized_weight import FP8_MAX, QuantizedWeight, QuantShape, pack_int4, weight_to
from xinserve.kernels.references import quant as quant_reference

MAX_SIDE = 320
PROBE_TOKENS = (1, 7, 33)  # a decode row, a short batch, one past torch._int_mm's 16-row minimum


def _cut(size: int, block: int) -> int:
    """``size`` cut to about MAX_SIDE, keeping its remainder modulo the block (a partial last block)."""
    if size <= MAX_SIDE or block >= size:
        return min(size, MAX_SIDE)
    return max(block, MAX_SIDE // block * block) + size % block


def random_weight(shape: QuantShape, generator: torch.Generator, rows: int | None = None,
                  cols: int | None = None) -> QuantizedWeight:
    """A record of ``shape`` on the host with seeded values, scaled so that ``x @ W.T`` stays below one
    (std ~0.4) for x of order one, as the probes' tolerances assume (a bf16 result of magnitude 10
    would round by 0.04); scales spread over a factor 4 between blocks, so a mis-applied one shows."""
    rows = rows or _cut(shape.out_features, shape.block[0])
    cols = cols or _cut(shape.in_features, shape.block[1])
    lead = (shape.experts,) if shape.experts else ()
    grid = (*lead, -(-rows // shape.block[0]), -(-cols // shape.block[1]))
    if shape.qtype == "fp8":
        values = torch.randn(*lead, rows, cols, generator=generator).clamp(-3, 3)
        qweight, magnitude = (values * 100).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), 200.0
    else:
        bound = 8 if shape.qtype == "int4" else 128
        values = torch.randint(-bound, bound, (*lead, rows, cols), generator=generator)
        qweight = pack_int4(values) if shape.qtype == "int4" else values.to(torch.int8)
        magnitude = float(bound)
    spread = 0.5 + 1.5 * torch.rand(*grid, generator=generator)
    scale = 0.5 * spread / (magnitude * cols**0.5)
    zero = torch.randint(-2, 3, grid, generator=generator).float() if shape.asymmetric else None
    static = shape.activation in ("int8_static", "fp8_static")
    # Not a round number: Ascend's quantize rounds x / s + o where the reference rounds x / s and adds o,
    # which part at exact ties (odd o); a round s makes those common for half-precision x.
    input_scale = torch.tensor(0.0297 if shape.activation == "int8_static" else 0.01) if static else None
    offset = torch.tensor(3.0) if shape.activation == "int8_static" else None
    return QuantizedWeight(qweight, 4 if shape.qtype == "int4" else 8, scale.float(), shape.block, cols, rows,
                           zero=zero, activation=shape.activation, input_scale=input_scale, input_offset=offset)


def probe_quant_linear(fn: dict[str, Callable], shapes: ModelShapes, x: ProbeInputs) -> float:
    errors = []
    for shape in (s for s in shapes.quant_shapes if not s.experts):
        weight = random_weight(shape, x.generator)
        bias = x.randn(weight.out_features)
        prepared = fn["prepare_quant_weight"](weight_to(weight, x.device), x.dtype)
        for tokens in PROBE_TOKENS:
            hidden = x.randn(tokens, weight.in_features)
            want = quant_reference.quant_linear(to_host32(hidden), weight, to_host32(bias))
            errors.append(max_error(fn["quant_linear"](hidden, prepared, bias), want))
    return max(errors)


def probe_quant_fused_moe(fn: dict[str, Callable], shapes: ModelShapes, x: ProbeInputs) -> float:
    # w13 and w2 of the model's experts, cut like the dense weights; 7 tokens top-2 leave experts idle
    by_side = {(s.out_features, s.in_features): s for s in shapes.quant_shapes if s.experts}
    errors = []
    for (out, inp), shape in by_side.items():
        if (inp, out // 2) not in by_side:  # w13 [E, 2I, Hd] pairs with w2 [E, Hd, I]
            continue
        inter, hidden_size = min(out // 2, 64), min(inp, 128)
        w13 = random_weight(shape, x.generator, 2 * inter, hidden_size)
        w2 = random_weight(by_side[(inp, out // 2)], x.generator, hidden_size, inter)
        prepared = fn["prepare_quant_experts"](weight_to(w13, x.device), weight_to(w2, x.device), x.dtype)
        for tokens in (7, 1):
            hidden = x.randn(tokens, hidden_size)
            ids = torch.randint(0, shape.experts, (tokens, 2), generator=x.generator)
            weights = torch.rand(tokens, 2, generator=x.generator)
            got = fn["quant_fused_moe"](hidden, prepared, weights.to(x.device), ids.to(x.device))
            errors.append(max_error(got, quant_reference.quant_fused_moe(to_host32(hidden), (w13, w2), weights, ids)))
    return max(errors, default=0.0)


def quant_linear_workload(fn: dict[str, Callable], shapes: ModelShapes, device: torch.device,
                          dtype: torch.dtype) -> Callable[[], object]:
    """One decode step's worth of the model's quantized linears at full size, batch 1 (the step the
    speed of a small-batch server rides on)."""
    generator = torch.Generator().manual_seed(0)
    calls = []
    for shape in (s for s in shapes.quant_shapes if not s.experts):
        weight = random_weight(shape, generator, shape.out_features, shape.in_features)
        prepared = fn["prepare_quant_weight"](weight_to(weight, device), dtype)
        calls.append((torch.randn(1, shape.in_features, generator=generator).to(device, dtype), prepared))
    return lambda: [fn["quant_linear"](hidden, prepared, None) for hidden, prepared in calls]


def quant_fused_moe_workload(fn: dict[str, Callable], shapes: ModelShapes, device: torch.device,
                             dtype: torch.dtype) -> Callable[[], object]:
    """One layer's experts at full size for a decode batch of 4 tokens, top-2."""
    generator = torch.Generator().manual_seed(0)
    by_side = {(s.out_features, s.in_features): s for s in shapes.quant_shapes if s.experts}
    (out, inp), shape = next(((side, s) for side, s in by_side.items() if (side[1], side[0] // 2) in by_side))
    w13 = weight_to(random_weight(shape, generator, out, inp), device)
    w2 = weight_to(random_weight(by_side[(inp, out // 2)], generator, inp, out // 2), device)
    prepared = fn["prepare_quant_experts"](w13, w2, dtype)
    hidden = torch.randn(4, inp, generator=generator).to(device, dtype)
    ids = torch.randint(0, shape.experts, (4, 2), generator=generator).to(device)
    weights = torch.rand(4, 2, generator=generator).to(device)
    return lambda: fn["quant_fused_moe"](hidden, prepared, weights, ids)


PROBES = {"quant_linear": probe_quant_linear, "quant_fused_moe": probe_quant_fused_moe}
WORKLOADS = {"quant_linear": quant_linear_workload, "quant_fused_moe": quant_fused_moe_workload}
