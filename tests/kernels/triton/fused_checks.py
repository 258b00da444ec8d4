"""What the tests of the fused elementwise Triton kernels (rms_norm, rotary, silu_and_mul) share: the dtypes,
and how close a kernel run by Triton's interpreter must land to the reference.

The kernels round where the reference rounds and the same way (kernels/triton/common.py ``rounded``), so
they agree with it to the bit but for float32 math in another order (a sum of squares, an exp): a result may
then round to the neighbouring value, one step of its dtype."""

import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ONE_STEP = {torch.float32: 2**-22, torch.float16: 2**-10, torch.bfloat16: 2**-7}


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """got equals want (same shape and dtype) within one step of want's dtype (relative to the smaller of
    the two: just below a power of two a step is twice the relative size it is above it)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=2 * ONE_STEP[want.dtype])
