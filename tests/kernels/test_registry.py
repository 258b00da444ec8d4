"""The kernel registry: the first candidate that imports, accepts the shapes, runs and agrees with
the reference is chosen; every other is kept with its reason; forced choices that cannot work stop
start-up with a clear message."""

import sys
import types
from dataclasses import replace

import pytest
import torch

from xinserve.engines import LLM, SamplingParams
from xinserve.engines.platforms.cpu import KERNEL_PREFERENCE as CPU_KERNELS
from xinserve.kernels import registry
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.references import dense as reference
from xinserve.kernels.registry import KernelSelectionError, parse_forced, select

SHAPES = ModelShapes(num_heads=6, num_kv_heads=2, head_dim=8, rotary_dim=8, rope_is_neox=True, hidden_size=48,
                     intermediate_size=40, vocab_size=100, block_size=4)
CPU = torch.device("cpu")
# the fake candidates of the ``candidates`` fixture, most preferred first
FAKES = ("absent", "raising", "off", "narrow", "good", "reference")


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
    monkeypatch.setitem(registry.MODULES, "absent", "xinserve.kernels.absent_vendor_module")


def test_cpu_times_its_decode_candidates_and_keeps_the_reference_elsewhere(monkeypatch, tmp_path):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    monkeypatch.setenv("XINSERVE_CACHE_DIR", str(tmp_path))  # a fresh timing cache
    monkeypatch.setenv(registry.TIMING_ENV_VAR, "on")
    selection = select(CPU_KERNELS, CPU, torch.float32, SHAPES)
    assert not selection.rejected
    # the only ops with two correct candidates: cpp decode, KV write and linear, sdpa prefill (kernels/cpu/sdpa_prefill.py)
    assert set(selection.timings_ms) == {"decode_attention", "prefill_attention", "write_kv", "linear"}
    timed = selection.timings_ms["decode_attention"]
    assert set(timed) == {"cpp", "reference"}
    assert selection.chosen["decode_attention"] == min(timed, key=timed.get)
    assert set(selection.timings_ms["prefill_attention"]) == {"sdpa", "reference"}
    assert selection.chosen["write_kv"] == min(selection.timings_ms["write_kv"], key=selection.timings_ms["write_kv"].get)
    attention = ("decode_attention", "prefill_attention", "write_kv", "linear")
    assert {op: name for op, name in selection.chosen.items() if op not in attention} == {
        op: "reference" for op in registry.OPS if op not in attention}
    assert selection.ops.rms_norm is reference.rms_norm
    assert (tmp_path / "kernel_timings.json").is_file()
    assert "timed cpp" in selection.table() and selection.report()["decode_attention"]["timings_ms"] == timed


def test_each_failing_candidate_is_rejected_with_its_reason(candidates):
    selection = select(FAKES, CPU, torch.float32, SHAPES)
    assert selection.chosen["silu_and_mul"] == "good"
    assert selection.ops.silu_and_mul is copy_of_reference
    reasons = dict(selection.rejected["silu_and_mul"])
    assert reasons["absent"].startswith("not installed (No module named 'xinserve.kernels.absent_vendor_module'")
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
    assert select(FAKES, CPU, torch.float32, SHAPES).chosen["silu_and_mul"] == "reference"
    # The model's config wins over the environment.
    assert select(FAKES, CPU, torch.float32, SHAPES, {"silu_and_mul": "good"}).chosen["silu_and_mul"] == "good"


def test_an_impossible_forced_choice_fails_with_the_reason(candidates):
    with pytest.raises(KernelSelectionError, match=r"silu_and_mul=off was forced .* max abs err 1.0e-01"):
        select(FAKES, CPU, torch.float32, SHAPES, {"silu_and_mul": "off"})
    with pytest.raises(KernelSelectionError, match=r"rms_norm=npu was forced .* not installed"):
        select(FAKES, CPU, torch.float32, SHAPES, {"rms_norm": "npu"})


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
    """The probes compare like with like: the reference, probed as a candidate, has no error
    (also for a windowed mixture-of-experts model, whose probes exercise the window and routing)."""
    from xinserve.kernels.probes.checks import PROBES, applies, probe
    from xinserve.kernels.routing import MoeRouting

    routing = MoeRouting(top_k=2, scoring="sigmoid", num_groups=2, correction_bias=True, scaling_factor=2.0)
    moe_windowed = replace(SHAPES, sliding_window=5, num_experts=8, moe_intermediate_size=24, moe_routing=routing)
    for shapes in (SHAPES, moe_windowed):
        for op in filter(lambda op: applies(op, shapes), PROBES):
            functions = {name: reference.OPS[name] for name in registry.OP_FUNCTIONS[op]}
            for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
                assert probe(op, functions, shapes, CPU, dtype) <= tolerance, (op, dtype, shapes)


def test_the_fastest_correct_candidate_wins_and_timings_are_cached(monkeypatch, tmp_path):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    monkeypatch.setenv("XINSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(registry.TIMING_ENV_VAR, "on")

    def slow(*args):
        return reference.paged_decode_attention(*args)

    def quick(*args):
        return reference.paged_decode_attention(*args)

    fake_module("slow", monkeypatch, OPS={"paged_decode_attention": slow})
    fake_module("quick", monkeypatch, OPS={"paged_decode_attention": quick})
    timed = ("slow", "quick", "reference")
    names = {slow: "slow", quick: "quick", reference.paged_decode_attention: "reference"}
    measured = {"slow": 3.0, "quick": 1.0, "reference": 2.0}
    calls = []

    def fake_measure(op, functions, shapes, device, dtype):
        calls.append(names[functions["paged_decode_attention"]])
        return measured[calls[-1]]

    monkeypatch.setattr(registry, "measure", fake_measure)
    first = select(timed, CPU, torch.float32, SHAPES)
    assert first.chosen["decode_attention"] == "quick"
    assert first.timings_ms["decode_attention"] == {"slow": 3000.0, "quick": 1000.0, "reference": 2000.0}
    assert sorted(calls) == ["quick", "reference", "slow"]
    calls.clear()
    assert select(timed, CPU, torch.float32, SHAPES).chosen["decode_attention"] == "quick"
    assert calls == []  # from the cache file
    forced = select(timed, CPU, torch.float32, SHAPES, {"decode_attention": "slow"})
    assert forced.chosen["decode_attention"] == "slow" and "decode_attention" not in forced.timings_ms


def test_ties_go_to_the_preferred_candidate():
    from xinserve.kernels.probes.timing import fastest

    assert fastest({"reference": 1.0, "cpp": 1.0}, ("cpp", "reference")) == "cpp"
    assert fastest({"reference": 0.5, "cpp": 1.0}, ("cpp", "reference")) == "reference"


def test_a_chosen_kernel_that_cannot_be_captured_is_reported_for_the_ops_the_model_calls(monkeypatch):
    """A function's ``graph_capturable = False`` reaches ``KernelSelection.uncapturable`` when its op
    is one the model calls; its ``graph_capture_hook`` reaches ``capture_hooks``."""
    monkeypatch.setenv(registry.TIMING_ENV_VAR, "off")

    def hook():
        raise AssertionError("only collected here, never entered")

    def frozen_silu(x: torch.Tensor) -> torch.Tensor:
        return reference.silu_and_mul(x).clone()

    def hooked_silu(x: torch.Tensor) -> torch.Tensor:
        return reference.silu_and_mul(x).clone()

    frozen_silu.graph_capturable = False
    hooked_silu.graph_capture_hook = hook
    fake_module("frozen", monkeypatch, OPS={"silu_and_mul": frozen_silu})
    fake_module("hooked", monkeypatch, OPS={"silu_and_mul": hooked_silu})
    assert select(CPU_KERNELS, CPU, torch.float32, SHAPES).uncapturable == {}  # the reference and cpp capture
    frozen = select(CPU_KERNELS, CPU, torch.float32, SHAPES, forced={"silu_and_mul": "frozen"})
    assert frozen.uncapturable == {"silu_and_mul": "frozen"} and frozen.capture_hooks == []
    assert "not graph-capturable" in frozen.table()
    hooked = select(CPU_KERNELS, CPU, torch.float32, SHAPES, forced={"silu_and_mul": "hooked"})
    assert hooked.uncapturable == {} and hooked.capture_hooks == [hook]
    # the reference MLA decode and DSA indexer: reported for an MLA / DSA model only
    dsa = replace(SHAPES, num_heads=4, num_kv_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, index_topk=4,
                  index_n_heads=2, index_head_dim=8)
    assert select(CPU_KERNELS, CPU, torch.float32, dsa).uncapturable == {"mla_decode_attention": "reference",
                                                                    "indexer_topk": "reference"}
