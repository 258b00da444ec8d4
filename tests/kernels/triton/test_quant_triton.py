"""The Triton quant_linear (kernels/triton/quant_gemm.py) under Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1): equal to the reference for every stored type, scale grid (partial blocks,
groups, channels, one per tensor), zero points and activation scheme, and accepted by the registry's
probe on a model's quantized shapes."""

import pytest
import torch

from tests.kernels.test_quant_kernels import SHAPES, model_shapes
from xinserve.kernels.probes.checks import TOLERANCE
from xinserve.kernels.probes.inputs import ProbeInputs, max_error
from xinserve.kernels.probes.quant import probe_quant_linear, random_weight
from xinserve.kernels.references import quant as quant_reference
from xinserve.kernels.triton import OPS, quant_gemm


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.qtype}-{s.block}-{s.activation}")
def test_triton_quant_linear_equals_the_reference(shape) -> None:
    gen = torch.Generator().manual_seed(4)
    weight = random_weight(shape, gen)
    bias = torch.randn(weight.out_features, generator=gen)
    prepared = quant_gemm.prepare_quant_weight(weight, torch.float32)
    for tokens in (1, 19):  # a decode row; rows past one BLOCK_M tile
        x = torch.randn(tokens, weight.in_features, generator=gen)
        assert max_error(quant_gemm.quant_linear(x, prepared, bias), quant_reference.quant_linear(x, weight, bias)) < 1e-4


def test_triton_quant_linear_passes_the_registry_probe_and_handles_no_rows() -> None:
    shapes = model_shapes(*SHAPES[2:4])  # block FP8 with a partial block, int4 groups with zero points
    assert probe_quant_linear(OPS, shapes, ProbeInputs(torch.device("cpu"), torch.float32)) <= TOLERANCE[torch.float32]
    weight = random_weight(SHAPES[2], torch.Generator())
    assert quant_gemm.quant_linear(torch.empty(0, weight.in_features), weight, None).shape == (0, weight.out_features)
