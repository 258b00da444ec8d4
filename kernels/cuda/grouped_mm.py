"""fused_moe through ``torch._grouped_mm``: each projection of every expert in one call, with the
expert boundaries passed as device offsets, so no per-expert loop and no host sync (the reference
reads the per-expert counts on the host). Routing is the reference's.

``torch._grouped_mm`` is a private torch op: importing this module raises ImportError where the
installed torch lacks it. torch 2.13 runs it on CPU in float32, float16 and bfloat16 (checked in
tests/kernels/test_fused_moe.py); on CUDA it is registered but not yet run on a GPU here. It wants
16-byte aligned rows; where it refuses a case the probe says so and the registry keeps the reference.

Shape letters as in kernels/references/dense.py.
"""

import torch

from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.references import dense as reference

if not hasattr(torch, "_grouped_mm"):
    raise ImportError(f"torch {torch.__version__} has no torch._grouped_mm")


# torch.compile cannot trace bincount (its output's length depends on the ids): it would break the
# compiled decode's graph in every MoE layer. As an opaque op the graph calls it whole.
@reference.opaque_moe_op("fused_moe_grouped_mm")
def fused_moe(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """hidden: [T, Hd]; w13: [E, 2I, Hd]; w2: [E, Hd, I]; topk_weights: [T, K] float32; topk_ids:
    [T, K]. Returns [T, Hd]."""
    order, tokens, rows = reference.sort_by_expert(hidden, topk_ids)  # rows: [T * K, Hd]
    # offsets: [E] int32, the end of each expert's rows in the sorted batch
    offsets = torch.bincount(topk_ids.reshape(-1), minlength=w13.shape[0]).cumsum(0).to(torch.int32)
    # the transposed weights are views ([E, Hd, 2I], [E, I, Hd]): the op takes them as they are
    gate_up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offsets)  # [T * K, 2I]
    down = torch._grouped_mm(reference.silu_and_mul(gate_up), w2.transpose(1, 2), offs=offsets)  # [T * K, Hd]
    return reference.add_back_to_tokens(down, topk_weights, order, tokens, hidden)


def unsupported(op: str, shapes: ModelShapes, dtype: torch.dtype) -> str | None:
    """Why ``torch._grouped_mm`` cannot serve the model's experts, or None."""
    if op != "fused_moe":
        return None
    row_bytes = {"hidden_size": shapes.hidden_size * dtype.itemsize,
                 "moe_intermediate_size": shapes.moe_intermediate_size * dtype.itemsize}
    for name, size in row_bytes.items():
        if size % 16:
            return f"{name} {size // dtype.itemsize} unsupported in {dtype} (rows must be 16-byte aligned)"
    return None


# function name -> function, as every implementation module exposes (kernels/ops.py)
OPS = {"select_experts": reference.select_experts, "fused_moe": fused_moe}
