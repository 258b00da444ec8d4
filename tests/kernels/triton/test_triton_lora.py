"""The Triton multi-LoRA ops (kernels/triton/lora.py) under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1): equal to the float32 reference on decode batches of 1 to 33 rows (the per-row bgmv
kernel and, past 32 rows, the grouped one) and on prefills in runs of one adapter, base-model rows bit for
bit untouched; accepted by the registry's probe, which rejects kernels with the classic mistakes; and
chosen by the registry for "lora" on the CUDA and MUSA preference lists when the model serves adapters."""

from dataclasses import replace

import pytest
import torch

from tests.kernels.lora_checks import assert_ops_match_reference
from xinserve.engines.platforms.cuda import KERNEL_PREFERENCE as CUDA_KERNELS
from xinserve.engines.platforms.musa import KERNEL_PREFERENCE as MUSA_KERNELS
from xinserve.kernels import registry
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.probes.checks import TOLERANCE, applies
from xinserve.kernels.probes.inputs import ProbeInputs, max_error
from xinserve.kernels.probes.lora import probe_lora
from xinserve.kernels.references import lora as reference
from xinserve.kernels.triton import OPS
from xinserve.kernels.triton import lora as triton_lora

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# the float32 bound is the interpreter's float32 accumulation in another order; the 16-bit ones the
# registry's (one rounding of results of order one)
TOLERANCE_OF = {torch.float32: 1e-5, torch.float16: TOLERANCE[torch.float16], torch.bfloat16: TOLERANCE[torch.bfloat16]}
SHAPES = ModelShapes(num_heads=4, num_kv_heads=2, head_dim=8, rotary_dim=8, rope_is_neox=True, hidden_size=32,
                     intermediate_size=48, vocab_size=64, block_size=16, max_lora_rank=8, max_loras=3)
SLOTS, RANK, IN, OUT = 3, 24, 40, 56  # R not a power of two, in and out not multiples of a tile


def stacks(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A [S, R, in] and B [S, O, R], scaled so that h and the delta are of order one half."""
    gen = torch.Generator().manual_seed(seed)
    a_stack = torch.randn(SLOTS, RANK, IN, generator=gen) * (0.5 * IN**-0.5)
    b_stack = torch.randn(SLOTS, OUT, RANK, generator=gen) * (0.5 * RANK**-0.5)
    return a_stack.to(dtype), b_stack.to(dtype)


def check_both_ops(slots: torch.Tensor, dtype: torch.dtype, seed: int = 0) -> None:
    """Shrink then expand through Triton and the float32 reference: close, in place, base rows untouched."""
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(len(slots), IN, generator=gen).to(dtype)
    before = (0.5 * torch.randn(len(slots), OUT, generator=gen)).to(dtype)
    assert_ops_match_reference(triton_lora.lora_shrink, triton_lora.lora_expand, x, *stacks(dtype, seed), before,
                               slots, TOLERANCE_OF[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_batches_of_1_to_33_rows_with_mixed_slots_equal_the_reference(dtype) -> None:
    # every third row count per dtype (the interpreter is slow), so the three cover 1..33 together; and
    # 33 for each: one past the per-row kernel's 32 rows
    gen = torch.Generator().manual_seed(3)
    for rows in [*range(1 + DTYPES.index(dtype), 33, 3), 33]:
        slots = torch.randint(-1, SLOTS, (rows,), generator=gen)
        slots[-1] = SLOTS - 1  # the last slot always, so an off-by-one in the stride shows
        check_both_ops(slots, dtype, seed=rows)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_prefill_in_runs_of_one_adapter_equals_the_reference(dtype) -> None:
    # 37 rows of slot 2 span three 16-row tiles; slot 1 has no row; base rows before, between and after
    runs = [(-1, 5), (0, 20), (2, 37), (-1, 9), (0, 3), (-1, 1)]
    slots = torch.repeat_interleave(torch.tensor([s for s, _ in runs]), torch.tensor([n for _, n in runs]))
    check_both_ops(slots, dtype)


@pytest.mark.parametrize("rows", [5, 40], ids=["bgmv", "grouped"])
def test_base_model_rows_are_bit_for_bit_untouched(rows) -> None:
    a_stack, b_stack = stacks(torch.bfloat16)
    slots = torch.full((rows,), -1)
    x, before = torch.randn(rows, IN).bfloat16(), torch.randn(rows, OUT).bfloat16()
    assert not triton_lora.lora_shrink(x, a_stack, slots).any()
    out = before.clone()
    triton_lora.lora_expand(out, torch.randn(rows, RANK).bfloat16(), b_stack, slots)
    assert torch.equal(out, before)


@pytest.mark.parametrize("rows", [6, 50], ids=["bgmv", "grouped"])
def test_expand_adds_into_a_column_slice_of_a_wider_output(rows) -> None:
    """A merged projection's output sliced per target: a strided view, updated in place, its neighbours kept."""
    _, b_stack = stacks(torch.float32)
    slots = torch.arange(rows) % (SLOTS + 1) - 1
    wide = torch.randn(rows, OUT + 20)
    before = wide.clone()
    h = torch.randn(rows, RANK)
    triton_lora.lora_expand(wide[:, 8 : 8 + OUT], h, b_stack, slots)
    want = reference.lora_expand(before[:, 8 : 8 + OUT].clone(), h, b_stack, slots)
    assert max_error(wide[:, 8 : 8 + OUT], want) <= 1e-5
    assert torch.equal(wide[:, :8], before[:, :8]) and torch.equal(wide[:, 8 + OUT :], before[:, 8 + OUT :])


def test_an_empty_step_is_a_no_op() -> None:
    a_stack, b_stack = stacks(torch.float32)
    slots = torch.empty(0, dtype=torch.int64)
    assert triton_lora.lora_shrink(torch.empty(0, IN), a_stack, slots).shape == (0, RANK)
    assert triton_lora.lora_expand(torch.empty(0, OUT), torch.empty(0, RANK), b_stack, slots).shape == (0, OUT)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_triton_ops_pass_the_registry_probe(dtype) -> None:
    assert probe_lora(OPS, SHAPES, ProbeInputs(CPU, dtype)) <= TOLERANCE[dtype]


def gather_expand(out, h, b_stack, slots):
    """The classic mistake: B gathered by slot without masking, so slot -1 picks the last adapter."""
    return out.add_(torch.einsum("tr,tor->to", h, b_stack[slots]))


def shifted_shrink(x, a_stack, slots):
    """An off-by-one: the next slot's A."""
    return reference.lora_shrink(x, a_stack, torch.where(slots >= 0, (slots + 1) % a_stack.shape[0], slots))


def copying_expand(out, h, b_stack, slots):
    """Right values, but in a new tensor: the model's output would never see the adapter."""
    return reference.lora_expand(out.clone(), h, b_stack, slots)


@pytest.mark.parametrize("wrong", [{"lora_expand": gather_expand}, {"lora_shrink": shifted_shrink},
                                   {"lora_expand": copying_expand}], ids=["unmasked", "off-by-one", "not-in-place"])
def test_the_probe_rejects_a_wrong_kernel(wrong) -> None:
    assert probe_lora({**OPS, **wrong}, SHAPES, ProbeInputs(CPU, torch.float32)) > 100 * TOLERANCE[torch.float32]


@pytest.mark.parametrize("preference", [CUDA_KERNELS, MUSA_KERNELS], ids=["cuda", "musa"])
def test_the_registry_chooses_triton_for_lora_when_the_model_serves_adapters(preference, monkeypatch) -> None:
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    only_lora = {op: "reference" for op in registry.OPS if op != "lora"}  # keeps the other ops' probes out
    selection = registry.select(preference, CPU, torch.float32, SHAPES, forced=only_lora)
    assert selection.chosen["lora"] == "triton", selection.rejected
    assert selection.ops.lora_shrink is triton_lora.lora_shrink and selection.ops.lora_expand is triton_lora.lora_expand
    assert "lora" not in selection.uncapturable
    # without adapters the model never calls the op: the reference stays, nothing probed or reported
    plain = registry.select(preference, CPU, torch.float32, replace(SHAPES, max_lora_rank=0), forced=only_lora)
    assert not applies("lora", replace(SHAPES, max_lora_rank=0))
    assert plain.chosen["lora"] == "reference"
    assert "triton" not in dict(plain.rejected.get("lora", []))


def test_with_timing_on_the_registry_times_both_correct_candidates_and_takes_the_faster(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    monkeypatch.setenv("XINSERVE_CACHE_DIR", str(tmp_path))  # a fresh timing cache
    monkeypatch.setenv(registry.TIMING_ENV_VAR, "on")
    only_lora = {op: "reference" for op in registry.OPS if op != "lora"}
    selection = registry.select(("triton", "reference"), CPU, torch.float32, SHAPES, forced=only_lora)
    timed = selection.timings_ms["lora"]
    assert set(timed) == {"triton", "reference"} and all(ms > 0 for ms in timed.values())
    assert selection.chosen["lora"] == min(timed, key=timed.get)
