"""FAKE torch_npu AddLora bindings (see the package docstring): ``npu_batch_gather_matmul`` and its in-place
form ``npu_batch_gather_matmul_`` (aclnnAddLora, torch_npu's BGMV). They check what the torch_npu
documentation and the CANN operator's tiling check (float16 only, int32 indices, 16-aligned sides, at most 32
weight sets, rank <= 128 with weight_a, no empty tensor) and compute the documented formula on CPU tensors:

    y[b, y_offset : y_offset + H2] += scale * (x[b] @ weight_a[i, layer_idx]^T) @ weight_b[i, layer_idx]^T

with i = indices[b]; a row whose index is outside [0, W) is left as it is. Products in float32, the first
rounded to float16 as the operator's fixpipe stores it, one rounding of each updated value to float16."""

import torch

OP = "aclnnAddLora"
ALIGN, MAX_WEIGHTS, MAX_RANK, MAX_SIDE = 16, 32, 128, 131072


def _check(ok: bool, detail: str, code: int = 161002) -> None:
    # 161002: a rejected argument (dtype); 561002: the tiling's refusal of a shape
    if not ok:
        raise RuntimeError(f"call {OP} failed, error code {code}: {detail}")


def _validate(y, x, weight_b, indices, weight_a, layer_idx, y_offset, y_slice_size) -> None:
    for name, tensor in (("y", y), ("x", x), ("weight_b", weight_b), ("weight_a", weight_a)):
        _check(tensor is None or tensor.dtype == torch.float16, f"{name} dtype {getattr(tensor, 'dtype', None)} "
               "unsupported (FLOAT16 only)")
    _check(indices.dtype == torch.int32, f"indices dtype {indices.dtype} unsupported (INT32 only)")
    _check(y.dim() == 2 and x.dim() == 2 and weight_b.dim() == 4 and indices.dim() == 1,
           "y and x must be 2-D, weight_b 4-D, indices 1-D", 561002)
    batch, (h3, h1), (weights, layers, h2, rank) = y.shape[0], (y.shape[1], x.shape[1]), weight_b.shape
    _check(batch > 0 and x.shape[0] == batch == indices.shape[0], "empty or mismatched batch", 561002)
    _check(h1 % ALIGN == 0 and h2 % ALIGN == 0 and h3 % ALIGN == 0 and rank % ALIGN == 0,
           f"H1 {h1}, H2 {h2}, H3 {h3} and R {rank} must be multiples of {ALIGN}", 561002)
    _check(h2 <= h3 <= MAX_SIDE, f"H2 {h2} must be at most y's width {h3}, itself at most {MAX_SIDE}", 561002)
    _check(weights <= MAX_WEIGHTS and 0 <= layer_idx < layers, f"{weights} weight sets (at most {MAX_WEIGHTS}), "
           f"layer_idx {layer_idx} of {layers}", 561002)
    if weight_a is None:
        _check(rank == h1, f"without weight_a, weight_b must be [W, L, H2, H1]: R {rank} != H1 {h1}", 561002)
    else:
        _check(tuple(weight_a.shape) == (weights, layers, rank, h1) and rank <= MAX_RANK,
               f"weight_a {tuple(weight_a.shape)} must be [W, L, R, H1] with R at most {MAX_RANK}", 561002)
    if y_slice_size not in (-1, h2) or y_offset + h2 > h3:
        raise NotImplementedError("the fake models updates of weight_b's H2 columns within y only")


def npu_batch_gather_matmul_(input, x, weight_b, indices, weight_a=None, layer_idx=0, scale=1e-3, y_offset=0,
                             y_slice_size=-1):
    """In place: adds each row's gathered product into ``input`` (y) and returns it."""
    _validate(input, x, weight_b, indices, weight_a, layer_idx, y_offset, y_slice_size)
    rows = ((indices >= 0) & (indices < weight_b.shape[0])).nonzero().squeeze(1)
    chosen = indices[rows].long()
    z = x[rows].float().unsqueeze(1)  # [B', 1, H1]
    if weight_a is not None:
        z = (z @ weight_a[chosen, layer_idx].float().transpose(1, 2)).half().float()  # [B', 1, R]
    z = (z @ weight_b[chosen, layer_idx].float().transpose(1, 2)).squeeze(1) * scale  # [B', H2]
    columns = slice(y_offset, y_offset + weight_b.shape[2])
    input[rows, columns] = (input[rows, columns].float() + z).half()
    return input


def npu_batch_gather_matmul(input, x, weight_b, indices, weight_a=None, layer_idx=0, scale=1e-3, y_offset=0,
                            y_slice_size=-1):
    """The out-of-place form: a new tensor, ``input`` untouched."""
    return npu_batch_gather_matmul_(input.clone(), x, weight_b, indices, weight_a, layer_idx, scale, y_offset,
                                    y_slice_size)
