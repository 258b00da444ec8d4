"""The kernel registry: the first candidate that imports, accepts the shapes, runs and agrees with
the reference is chosen; every other is kept with its reason; forced choices that cannot work stop
start-up with a clear message."""

import sys
import types

import pytest
import torch

from engines import LLM, SamplingParams
from kernels import reference, registry
from kernels.probes import ModelShapes
from kernels.registry import KernelSelectionError, parse_forced, select

SHAPES = ModelShapes(num_heads=6, num_kv_heads=2, head_dim=8, rotary_dim=8, rope_is_neox=True, hidden_size=48,
                     intermediate_size=40, vocab_size=100, block_size=4)
CPU = torch.device("cpu")


def fake_module(name: str, monkeypatch, **attrs) -> None:
    """A stand-in implementation module, importable as kernels.<name>."""
    module = types.ModuleType(f"kernels.{name}")
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, f"kernels.{name}", module)
    monkeypatch.setitem(registry.MODULES, name, f"kernels.{name}")


def raises(*args, **kwargs):
    raise RuntimeError("aclnnSwiGlu failed, error code 161002\nmore detail")


def off_by_a_little(x: torch.Tensor) -> torch.Tensor:
    return reference.silu_and_mul(x) + 0.1


def copy_of_reference(x: torch.Tensor) -> torch.Tensor:
    return reference.silu_and_mul(x).clone()


@pytest.fixture
def candidates(monkeypatch):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    fake_module("raising", monkeypatch, OPS={"silu_and_mul": raises})
    fake_module("off", monkeypatch, OPS={"silu_and_mul": off_by_a_little})
    fake_module("narrow", monkeypatch, OPS={"silu_and_mul": copy_of_reference},
                unsupported=lambda op, shapes, dtype: f"head_dim {shapes.head_dim} unsupported")
    fake_module("good", monkeypatch, OPS={"silu_and_mul": copy_of_reference})
    monkeypatch.setitem(registry.MODULES, "absent", "kernels.absent_vendor_module")
    monkeypatch.setitem(registry.PREFERENCE, "cpu", ("absent", "raising", "off", "narrow", "good", "reference"))


def test_cpu_uses_the_reference_for_every_op(monkeypatch):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    selection = select("cpu", CPU, torch.float32, SHAPES)
    assert set(selection.chosen.values()) == {"reference"} and not selection.rejected
    assert selection.ops.rms_norm is reference.rms_norm


def test_each_failing_candidate_is_rejected_with_its_reason(candidates):
    selection = select("cpu", CPU, torch.float32, SHAPES)
    assert selection.chosen["silu_and_mul"] == "good"
    assert selection.ops.silu_and_mul is copy_of_reference
    reasons = dict(selection.rejected["silu_and_mul"])
    assert reasons["absent"].startswith("not installed (No module named 'kernels.absent_vendor_module'")
    assert reasons["raising"] == "raised RuntimeError: aclnnSwiGlu failed, error code 161002"
    assert reasons["off"] == "max abs err 1.0e-01 > 2e-03"
    assert reasons["narrow"] == "head_dim 8 unsupported"
    # Implementations that do not provide an op are not candidates for it: only the absent one
    # (which might have) is reported for the other ops.
    assert selection.chosen["rms_norm"] == "reference"
    assert [impl for impl, _ in selection.rejected["rms_norm"]] == ["absent"]
    assert "good" in selection.table() and "161002" in selection.table()
    assert selection.report()["silu_and_mul"]["chosen"] == "good"


def test_forcing_by_environment_and_by_config(candidates, monkeypatch):
    monkeypatch.setenv(registry.ENV_VAR, "silu_and_mul=reference")
    assert select("cpu", CPU, torch.float32, SHAPES).chosen["silu_and_mul"] == "reference"
    # The model's config wins over the environment.
    assert select("cpu", CPU, torch.float32, SHAPES, {"silu_and_mul": "good"}).chosen["silu_and_mul"] == "good"


def test_an_impossible_forced_choice_fails_with_the_reason(candidates):
    with pytest.raises(KernelSelectionError, match=r"silu_and_mul=off was forced .* max abs err 1.0e-01"):
        select("cpu", CPU, torch.float32, SHAPES, {"silu_and_mul": "off"})
    with pytest.raises(KernelSelectionError, match=r"rms_norm=npu was forced .* not installed"):
        select("cpu", CPU, torch.float32, SHAPES, {"rms_norm": "npu"})


@pytest.mark.parametrize("text", ["silu_and_mul", "flash=triton", "rms_norm=cudnn"])
def test_malformed_forcing_is_refused(text):
    with pytest.raises(KernelSelectionError, match="expected op=impl"):
        parse_forced(text)


def test_engine_start_up_fails_clearly_on_an_impossible_forced_kernel(tiny_models, monkeypatch):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    with pytest.raises(KernelSelectionError, match="decode_attention=npu was forced"):
        LLM(tiny_models("llama"), num_kv_blocks=16, kernels={"decode_attention": "npu"})


def test_the_model_calls_the_chosen_implementation(tiny_models, monkeypatch):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    calls = []

    def counting(x: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return reference.silu_and_mul(x)

    fake_module("counting", monkeypatch, OPS={"silu_and_mul": counting})
    forced = LLM(tiny_models("llama"), num_kv_blocks=16, kernels={"silu_and_mul": "counting"})
    probed = len(calls)
    assert probed == 1  # the start-up probe
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    plain = LLM(tiny_models("llama"), num_kv_blocks=16)
    assert forced.generate(["The fox"], params)[0].token_ids == plain.generate(["The fox"], params)[0].token_ids
    assert len(calls) > probed
    assert forced.engine.runner.kernels.chosen["silu_and_mul"] == "counting"


def test_every_probe_accepts_the_reference_itself(monkeypatch):
    """The probes compare like with like: the reference, probed as a candidate, has no error."""
    from kernels.probes import PROBES, probe

    for op in PROBES:
        functions = {name: reference.OPS[name] for name in registry.OP_FUNCTIONS[op]}
        for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
            assert probe(op, functions, SHAPES, CPU, dtype) <= tolerance, (op, dtype)
