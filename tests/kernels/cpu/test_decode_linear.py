"""The C++ decode linear (kernels/cpu/csrc/decode_linear.cpp) against F.linear: odd shapes, every row count
up to past its limit, bias, half-precision weights, strided inputs; the registry's choice and its
fallback; the op inside a compiled graph."""

import sys

import pytest
import torch
import torch.nn.functional as F

from xinserve.engines.models.layers import Linear, MergedLinear
from xinserve.engines.platforms.cpu import KERNEL_PREFERENCE as CPU_KERNELS
from xinserve.kernels import registry
from xinserve.kernels.cpu import cpp
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.ops import OPS, KernelOps
from xinserve.kernels.references import dense as reference

SHAPES = ModelShapes(num_heads=4, num_kv_heads=2, head_dim=8, rotary_dim=8, rope_is_neox=True, hidden_size=40,
                     intermediate_size=36, vocab_size=50, block_size=4)
CPU = torch.device("cpu")


def case(rows: int, n_out: int, k: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    weight = (torch.randn(n_out, k, generator=g) * k**-0.5).to(dtype)
    bias = torch.randn(n_out, generator=g).to(dtype)
    return x, weight, bias


@pytest.mark.parametrize(("n_out", "k"), [(1, 1), (3, 7), (13, 37), (64, 256), (37, 300), (6, 1030)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_f_linear_for_every_row_count_and_odd_shape(n_out, k, with_bias):
    # K not a multiple of the vector width, N not of the 4-row block, M past the kernel's limit (F.linear)
    for rows in range(1, 34):
        x, weight, bias = case(rows, n_out, k, seed=rows)
        bias = bias if with_bias else None
        got = cpp.linear(x, weight, bias)
        torch.testing.assert_close(got, F.linear(x, weight, bias), atol=2e-5, rtol=1e-5)


def test_the_extension_itself_for_rows_past_the_routing_limit():
    x, weight, bias = case(33, 29, 200)
    torch.testing.assert_close(cpp._extension.decode_linear(x, weight, bias), F.linear(x, weight, bias),
                               atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_half_precision_weights_accumulate_in_float32(dtype, tol):
    for rows in (1, 5, 16, 17, 32):  # the dot-product tiles, then the broadcast tiles (N = 47: a tail of 2 rows)
        x, weight, bias = case(rows, 47, 259, dtype, seed=rows)
        got = cpp.linear(x, weight, bias)
        assert got.dtype == dtype
        want = F.linear(x.float(), weight.float(), bias.float())
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_two_threads_split_the_weight_rows_alike():
    # the broadcast tiles' blocks of 3 weight rows and the dot-product tiles' blocks of 4, over 2 threads
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for rows in (3, 8, 9, 24, 32):
            x, weight, bias = case(rows, 301, 520, seed=rows)
            torch.testing.assert_close(cpp.linear(x, weight, bias), F.linear(x, weight, bias), atol=2e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_strided_rows_and_a_transposed_weight():
    x, weight, bias = case(8, 20, 48)
    wide = torch.randn(8, 96)
    strided = wide[:, ::2]  # K not contiguous: widened to contiguous rows
    rows_apart = wide[:, :48]  # rows 96 apart, K contiguous
    for view in (strided, rows_apart):
        torch.testing.assert_close(cpp.linear(view, weight, bias), F.linear(view, weight, bias), atol=2e-5, rtol=1e-5)
    transposed = torch.randn(48, 20).t()  # not contiguous: F.linear's path
    torch.testing.assert_close(cpp.linear(x, transposed), F.linear(x, transposed), atol=2e-5, rtol=1e-5)


def test_bad_inputs_raise():
    x, weight, _ = case(2, 5, 8)
    with pytest.raises(RuntimeError, match="differ in dtype"):
        cpp._extension.decode_linear(x, weight.double().float().half())
    with pytest.raises(RuntimeError, match=r"x \[M, K\] and weight \[N, K\]"):
        cpp._extension.decode_linear(x, weight[:, :7].contiguous())
    with pytest.raises(RuntimeError, match="bias"):
        cpp._extension.decode_linear(x, weight, torch.zeros(4))
    assert cpp._extension.decode_linear(x[:0], weight).shape == (0, 5)


def test_model_layers_multiply_with_the_chosen_linear():
    calls = []

    def counting(x, weight, bias=None):
        calls.append(tuple(weight.shape))
        return F.linear(x, weight, bias)

    ops = KernelOps.from_functions({**reference.OPS, "linear": counting})
    qkv, o_proj = MergedLinear(16, [8, 4, 4], True, ops), Linear(8, 16, False, ops)
    x = torch.randn(3, 16)
    torch.testing.assert_close(qkv(x), F.linear(x, qkv.weight, qkv.bias))
    o_proj(torch.randn(3, 8))
    assert calls == [(16, 16), (16, 8)]


def test_a_kernel_built_in_the_background_is_swapped_into_the_linear_layers():
    from xinserve.engines.worker.warmup import swap_ops

    old, new = reference_ops(), KernelOps.from_functions({**reference.OPS, "linear": cpp.linear})
    model = torch.nn.Sequential(MergedLinear(16, [8, 8], False, old), Linear(16, 4, True, old))
    swap_ops(model, old, new)
    assert all(layer.ops.linear is cpp.linear for layer in model)


def reference_ops() -> KernelOps:
    return KernelOps.from_functions(dict(reference.OPS))


def test_the_registry_probes_and_times_the_cpp_linear(monkeypatch, tmp_path):
    monkeypatch.setenv("XINSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(registry.TIMING_ENV_VAR, "on")
    monkeypatch.setattr("xinserve.kernels.probes.linear.COLD_BYTES", 4 << 20)  # a quick timing: the choice is not tested
    selection = select_linear(monkeypatch)
    assert "linear" not in selection.rejected
    assert set(selection.timings_ms["linear"]) == {"cpp", "reference"}
    assert selection.ops.linear is {"cpp": cpp.linear, "reference": F.linear}[selection.chosen["linear"]]


def test_the_registry_falls_back_to_f_linear_without_the_extension(monkeypatch):
    monkeypatch.setitem(sys.modules, "xinserve.kernels.cpu.cpp", None)  # importing it raises ImportError, as an unbuildable one
    selection = select_linear(monkeypatch)
    assert selection.chosen["linear"] == "reference" and selection.ops.linear is F.linear
    assert selection.rejected["linear"][0][0] == "cpp"
    assert selection.rejected["linear"][0][1].startswith("not installed")


def select_linear(monkeypatch) -> registry.KernelSelection:
    """The registry's choice of the linear; every other op forced to the reference (nothing else probed)."""
    others = ",".join(f"{op}=reference" for op in OPS if op != "linear")
    monkeypatch.setenv(registry.ENV_VAR, others)
    return registry.select(CPU_KERNELS, CPU, torch.float32, SHAPES)


def test_a_compiled_graph_calls_the_op():
    from torch._inductor.utils import run_and_get_code

    layer = Linear(40, 24, True, KernelOps.from_functions({**reference.OPS, "linear": cpp.linear}))
    x = torch.randn(8, 40)
    with torch.inference_mode():
        got, code = run_and_get_code(torch.compile(lambda t: torch.relu(layer(t)), dynamic=False), x)
    assert "decode_linear" in "\n".join(code)
    torch.testing.assert_close(got, torch.relu(F.linear(x, layer.weight, layer.bias)), atol=2e-5, rtol=1e-5)


def test_greedy_generation_with_the_cpp_linear_equals_f_linear(tiny_models):
    from xinserve.engines import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["Once upon a time " * k for k in (1, 4, 9)]  # a decode batch of 3, prefills through F.linear
    runs = {}
    for impl in ("cpp", "reference"):
        with LLM(tiny_models("llama"), num_kv_blocks=40, block_size=4, kernels={"linear": impl}) as llm:
            assert llm.engine.runner.kernels.chosen["linear"] == impl
            runs[impl] = [o.token_ids for o in llm.generate(prompts, params)]
    assert runs["cpp"] == runs["reference"]
