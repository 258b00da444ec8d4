"""The Triton SiLU-and-mul (kernels/triton/activation.py) under Triton's interpreter: [T, 2I] -> [T, I] equal to
the reference for 1 and 33 tokens and an I that is no power of two and spans several column tiles; out of
place; accepted by the registry's probe, which rejects gate and up swapped."""

import pytest
import torch

from tests.kernels.triton.fused_checks import DTYPES, assert_close
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.probes.checks import TOLERANCE, probe_silu_and_mul
from xinserve.kernels.probes.inputs import ProbeInputs
from xinserve.kernels.references import dense as reference
from xinserve.kernels.triton import OPS
from xinserve.kernels.triton.activation import COLUMNS_TILE, silu_and_mul

CPU = torch.device("cpu")
SHAPES = ModelShapes(num_heads=4, num_kv_heads=2, head_dim=24, rotary_dim=24, rope_is_neox=True, hidden_size=64,
                     intermediate_size=1100, vocab_size=64, block_size=16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens, inner", [(1, 1100), (33, 300), (4, 2 * COLUMNS_TILE + 5)])
def test_equals_the_reference(dtype, tokens, inner) -> None:
    gate_up = (3 * torch.randn(tokens, 2 * inner, generator=torch.Generator().manual_seed(inner))).to(dtype)
    before = gate_up.clone()
    assert_close(silu_and_mul(gate_up), reference.silu_and_mul(gate_up))
    assert torch.equal(gate_up, before)


def test_leading_dims_are_kept_and_an_empty_step_is_empty() -> None:
    gate_up = torch.randn(2, 3, 2 * 40)
    assert_close(silu_and_mul(gate_up), reference.silu_and_mul(gate_up))
    assert silu_and_mul(torch.empty(0, 2 * 40)).shape == (0, 40)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_registry_probe_accepts_it(dtype) -> None:
    assert probe_silu_and_mul(OPS, SHAPES, ProbeInputs(CPU, dtype)) <= TOLERANCE[dtype]


def test_the_probe_rejects_gate_and_up_swapped() -> None:
    def swapped(x):
        return silu_and_mul(torch.cat(x.chunk(2, dim=-1)[::-1], dim=-1))

    assert probe_silu_and_mul({"silu_and_mul": swapped}, SHAPES, ProbeInputs(CPU, torch.float32)) > 0.1
