"""The Ascend multi-LoRA candidate (kernels/ascend/lora.py) through the fake torch_npu's AddLora binding
(tests/fakes/torch_npu/lora.py): equal to the reference, base-model rows untouched, passed by the registry's
probe and chosen on an "npu" platform for a float16 model with 16-aligned sides; declined with its reason
where AddLora cannot serve (bfloat16, unaligned sides, more than 32 slots) so the reference serves and is
reported; and the fake refuses what the operator's documentation and tiling refuse."""

from dataclasses import replace
from types import ModuleType

import pytest
import torch

from tests.kernels.lora_checks import assert_ops_match_reference
from xinserve.engines.platforms.npu import KERNEL_PREFERENCE as NPU_KERNELS
from xinserve.kernels import registry
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.probes.checks import TOLERANCE
from xinserve.kernels.probes.inputs import ProbeInputs, max_error
from xinserve.kernels.probes.lora import probe_lora
from xinserve.kernels.references import lora as reference

CPU = torch.device("cpu")
HALF = torch.float16
# AddLora's sides: 16-aligned hidden / q / kv / intermediate sizes and rank
SHAPES = ModelShapes(num_heads=4, num_kv_heads=2, head_dim=16, rotary_dim=16, rope_is_neox=True, hidden_size=64,
                     intermediate_size=96, vocab_size=300, block_size=128, max_lora_rank=16, max_loras=3)
ONLY_LORA = {op: "reference" for op in registry.OPS if op != "lora"}  # keeps the other ops' probes out


@pytest.fixture(scope="module")
def lora(npu) -> ModuleType:
    import xinserve.kernels.ascend.lora

    return xinserve.kernels.ascend.lora


@pytest.fixture
def fake(npu) -> ModuleType:
    return npu.torch_npu


@pytest.mark.parametrize("rows", [1, 7, 40])
def test_shrink_and_expand_equal_the_reference(lora, rows):
    gen = torch.Generator().manual_seed(rows)
    slots = torch.randint(-1, 3, (rows,), generator=gen)
    slots[0] = -1
    x = torch.randn(rows, 64, generator=gen).half()
    a_stack = (torch.randn(3, 32, 64, generator=gen) * 0.06).half()
    b_stack = (torch.randn(3, 48, 32, generator=gen) * 0.09).half()
    before = torch.randn(rows, 48, generator=gen).half()
    assert_ops_match_reference(lora.lora_shrink, lora.lora_expand, x, a_stack, b_stack, before, slots, TOLERANCE[HALF])


def test_the_npu_candidate_passes_the_registry_probe(npu):
    assert probe_lora(npu.OPS, SHAPES, ProbeInputs(CPU, HALF)) <= TOLERANCE[HALF]


def test_the_registry_chooses_npu_for_lora_in_float16(lora, no_forced_kernels):
    selection = registry.select(NPU_KERNELS, CPU, HALF, SHAPES, forced=ONLY_LORA)
    assert selection.chosen["lora"] == "npu", selection.rejected
    assert selection.ops.lora_shrink is lora.lora_shrink and selection.ops.lora_expand is lora.lora_expand


@pytest.mark.parametrize("dtype, change, reason", [
    (torch.bfloat16, {}, "bfloat16 unsupported (AddLora takes float16 only)"),
    (HALF, {"max_lora_rank": 8}, "max_lora_rank 8 unsupported (AddLora: multiples of 16)"),
    (HALF, {"intermediate_size": 88}, "intermediate_size 88 unsupported (AddLora: multiples of 16)"),
    (HALF, {"max_loras": 33}, "max_loras 33 unsupported (AddLora: at most 32 adapters)"),
], ids=["bf16", "rank-8", "intermediate-88", "33-slots"])
def test_where_addlora_cannot_serve_the_reference_does_and_the_reason_is_reported(npu, no_forced_kernels, dtype,
                                                                                 change, reason):
    selection = registry.select(NPU_KERNELS, CPU, dtype, replace(SHAPES, **change), forced=ONLY_LORA)
    assert selection.chosen["lora"] == "reference"
    assert selection.rejected["lora"] == [("npu", reason)]
    assert selection.report()["lora"] == {"chosen": "reference", "rejected": [{"impl": "npu", "reason": reason}]}


def test_a_failing_addlora_falls_back_to_the_reference_with_its_error(fake, no_forced_kernels, monkeypatch):
    def refused(*args, **kwargs):  # what an Atlas A3, which AddLora does not support, answers
        raise RuntimeError("call aclnnAddLora failed, error code 561002")

    monkeypatch.setattr(fake, "npu_batch_gather_matmul_", refused)
    selection = registry.select(NPU_KERNELS, CPU, HALF, SHAPES, forced=ONLY_LORA)
    assert selection.chosen["lora"] == "reference"
    assert selection.rejected["lora"] == [("npu", "raised RuntimeError: call aclnnAddLora failed, error code 561002")]


def test_the_fake_fused_form_is_shrink_then_expand(fake):
    """With weight_a, one call is both products (scale applied once): the formula the fake models."""
    gen = torch.Generator().manual_seed(0)
    slots = torch.tensor([2, -1, 0, 2], dtype=torch.int32)
    x, y = torch.randn(4, 32, generator=gen).half(), torch.randn(4, 48, generator=gen).half()
    a, b = (torch.randn(3, 1, 16, 32, generator=gen) * 0.2).half(), (torch.randn(3, 1, 48, 16, generator=gen) * 0.2).half()
    got = fake.npu_batch_gather_matmul(y, x, b, slots, a, scale=0.5)
    h = reference.lora_shrink(x.float(), a[:, 0].float(), slots.long())
    want = reference.lora_expand(y.float(), h, b[:, 0].float() * 0.5, slots.long())
    assert max_error(got, want) <= TOLERANCE[HALF] and not torch.equal(got, y)  # out of place: y kept


def _valid_call() -> dict:
    return {"input": torch.zeros(2, 32).half(), "x": torch.zeros(2, 64).half(),
            "weight_b": torch.zeros(3, 1, 32, 64).half(), "indices": torch.tensor([0, -1], dtype=torch.int32)}


@pytest.mark.parametrize("change, match", [
    ({"input": torch.zeros(2, 32).bfloat16()}, "y dtype torch.bfloat16 unsupported"),
    ({"indices": torch.tensor([0, -1])}, "indices dtype torch.int64 unsupported"),
    ({"x": torch.zeros(2, 24).half(), "weight_b": torch.zeros(3, 1, 32, 24).half()}, "multiples of 16"),
    ({"weight_b": torch.zeros(33, 1, 32, 64).half()}, "33 weight sets"),
    ({"weight_b": torch.zeros(3, 1, 48, 64).half()}, "H2 48 must be at most y's width 32"),
    ({"weight_b": torch.zeros(3, 1, 32, 32).half()}, "R 32 != H1 64"),
    ({"input": torch.zeros(0, 32).half(), "x": torch.zeros(0, 64).half(),
      "indices": torch.zeros(0, dtype=torch.int32)}, "empty"),
], ids=["bf16", "int64-indices", "unaligned", "33-sets", "too-wide", "rank-mismatch", "empty"])
def test_the_fake_refuses_what_addlora_refuses(fake, change, match):
    fake.npu_batch_gather_matmul_(**_valid_call())  # the unchanged call is accepted
    with pytest.raises(RuntimeError, match=match):
        fake.npu_batch_gather_matmul_(**{**_valid_call(), **change})
    fused = {**_valid_call(), "weight_b": torch.zeros(3, 1, 32, 144).half(), "weight_a": torch.zeros(3, 1, 144, 64).half()}
    with pytest.raises(RuntimeError, match="R at most 128"):  # the fused form's rank limit
        fake.npu_batch_gather_matmul_(**fused)
