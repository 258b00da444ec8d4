"""Multi-LoRA's shrink and expand on Ascend (the reference and its contract: kernels/references/lora.py)
through torch_npu's ``npu_batch_gather_matmul_``, the in-place binding of CANN's AddLora operator
(aclnnAddLora; torch_npu calls it a BGMV):

    npu_batch_gather_matmul_(y, x, weight_b, indices, weight_a=None, layer_idx=0, scale=1e-3, y_offset=0,
                             y_slice_size=-1)
    y[b, y_offset : y_offset + H2] += scale * (x[b] @ weight_a[i, layer_idx]^T) @ weight_b[i, layer_idx]^T,
    i = indices[b]; rows whose index is outside [0, W) (our -1) are left as they are.

Without ``weight_a`` the first product is skipped and weight_b is [W, L, H2, H1]: one gathered matmul,
which is each of our two ops with a one-layer view of the stack: shrink is y = h (zeros) [T, R] with
weight_b = A [S, 1, R, in]; expand is y = out [T, O] with weight_b = B [S, 1, O, R]. Scale 1: ours is
folded into B.

The operator's limits (torch_npu / CANN documentation and the tiling's checks, ``lora_limits``): float16
only; x's and y's widths and weight_b's last two sides multiples of 16, the outputs at most 131072; at
most 32 weight sets (adapter slots); no empty tensor; int32 indices. The rank limit of 128 the
documentation states holds only for the fused form with weight_a, which is not used here. Atlas A2 and
Atlas inference (310P) products only: on Atlas A3 it raises, and the registry keeps the reference. Importing
this module raises ImportError where torch_npu is missing.
"""

import torch
import torch_npu

from xinserve.kernels.model_shapes import ModelShapes

ALIGN = 16
MAX_SLOTS = 32  # W
MAX_OUTPUT = 131072  # y's width (H3) and weight_b's H2


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x: [T, in]; a_stack: [S, R, in]; slots: [T] int64 in [-1, S). Returns [T, R] (zeros where the slot is -1)."""
    out = x.new_zeros(x.shape[0], a_stack.shape[1])
    if x.shape[0]:  # the operator rejects empty tensors
        torch_npu.npu_batch_gather_matmul_(out, x, a_stack.unsqueeze(1), slots.to(torch.int32), scale=1.0)
    return out


def lora_expand(out: torch.Tensor, h: torch.Tensor, b_stack: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """out: [T, O]; h: [T, R]; b_stack: [S, O, R]. Adds h[t] @ B[slot]^T to out[t] in place and returns out."""
    if out.shape[0]:
        torch_npu.npu_batch_gather_matmul_(out, h, b_stack.unsqueeze(1), slots.to(torch.int32), scale=1.0)
    return out


def lora_limits(shapes: ModelShapes, dtype: torch.dtype) -> str | None:
    """Why AddLora cannot take this model's adapters: the widths of the four adapted projections (their
    inputs, outputs and stacked ranks), the slot count and the dtype."""
    if dtype != torch.float16:
        return f"{str(dtype).removeprefix('torch.')} unsupported (AddLora takes float16 only)"
    if shapes.max_loras > MAX_SLOTS:
        return f"max_loras {shapes.max_loras} unsupported (AddLora: at most {MAX_SLOTS} adapters)"
    q, kv = shapes.num_heads * shapes.head_dim, shapes.num_kv_heads * shapes.head_dim
    sides = {"max_lora_rank": shapes.max_lora_rank, "hidden_size": shapes.hidden_size, "q size": q,
             "kv size": kv, "intermediate_size": shapes.intermediate_size}
    unaligned = [f"{name} {size}" for name, size in sides.items() if size % ALIGN]
    if unaligned:
        return f"{', '.join(unaligned)} unsupported (AddLora: multiples of {ALIGN})"
    widest = max(q + 2 * kv, 2 * shapes.intermediate_size, shapes.hidden_size)
    if widest > MAX_OUTPUT:
        return f"projection width {widest} unsupported (AddLora: at most {MAX_OUTPUT})"
    return None


OPS = {fn.__name__: fn for fn in (lora_shrink, lora_expand)}
LIMITS = {"lora": lora_limits}
