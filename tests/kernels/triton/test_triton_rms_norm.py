"""The Triton RMSNorm (kernels/triton/norm.py) under Triton's interpreter: equal to the reference with
and without the fused residual add, at sizes that are no power of two, 1 and 33 rows, on strided heads
of a fused projection (Qwen3's q/k norm); out of place; accepted by the registry's probe, and a kernel
that skips the residual add is not."""

import pytest
import torch

from tests.kernels.triton.fused_checks import DTYPES, assert_close
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.probes.checks import TOLERANCE, probe_rms_norm
from xinserve.kernels.probes.inputs import ProbeInputs
from xinserve.kernels.references import dense as reference
from xinserve.kernels.triton import OPS, unsupported
from xinserve.kernels.triton.norm import MAX_SIZE, rms_norm

CPU = torch.device("cpu")
SHAPES = ModelShapes(num_heads=4, num_kv_heads=2, head_dim=24, rotary_dim=24, rope_is_neox=True, hidden_size=200,
                     intermediate_size=48, vocab_size=64, block_size=16)


def inputs(rows: int, size: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x, residual = (2 * torch.randn(rows, size, generator=gen)).to(dtype), torch.randn(rows, size, generator=gen).to(dtype)
    return x, residual, (1 + 0.1 * torch.randn(size, generator=gen)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, size", [(1, 200), (33, 200), (5, 1000), (3, 24)])
def test_with_and_without_the_residual_equals_the_reference(dtype, rows, size) -> None:
    x, residual, weight = inputs(rows, size, dtype)
    before = (x.clone(), residual.clone())
    assert_close(rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))
    normed, added = rms_norm(x, weight, 1e-6, residual)
    want_normed, want_added = reference.rms_norm(x, weight, 1e-6, residual)
    assert_close(added, want_added)
    assert_close(normed, want_normed)
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])  # out of place


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_heads_of_a_fused_projection_equal_the_reference(dtype) -> None:
    # q: [T, H, D] heads sliced from a [T, (H + 2 KVH) D] projection: rows 96 apart, heads 24 apart
    qkv = torch.randn(7, 4 * 24, generator=torch.Generator().manual_seed(1)).to(dtype)
    q = qkv[:, : 2 * 24].view(7, 2, 24)
    assert not q.is_contiguous()
    weight = torch.linspace(0.5, 1.5, 24).to(dtype)
    assert_close(rms_norm(q, weight, 1e-5), reference.rms_norm(q, weight, 1e-5))


def test_an_empty_step_returns_empty_rows() -> None:
    x, residual, weight = inputs(0, 200, torch.float32)
    normed, added = rms_norm(x, weight, 1e-6, residual)
    assert normed.shape == added.shape == (0, 200)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_registry_probe_accepts_it(dtype) -> None:
    assert probe_rms_norm(OPS, SHAPES, ProbeInputs(CPU, dtype)) <= TOLERANCE[dtype]


def test_the_probe_rejects_a_kernel_that_drops_the_residual_add() -> None:
    def no_add(x, weight, eps, residual=None):
        normed = rms_norm(x, weight, eps)
        return normed if residual is None else (normed, x)

    assert probe_rms_norm({"rms_norm": no_add}, SHAPES, ProbeInputs(CPU, torch.float32)) > 0.1


def test_a_row_too_wide_for_one_program_is_declined_with_its_reason() -> None:
    from dataclasses import replace

    wide = replace(SHAPES, hidden_size=MAX_SIZE + 1)
    assert unsupported("rms_norm", wide, torch.bfloat16) == (
        f"hidden size {MAX_SIZE + 1} unsupported (one row per program, at most {MAX_SIZE})")
    assert unsupported("rms_norm", SHAPES, torch.bfloat16) is None
