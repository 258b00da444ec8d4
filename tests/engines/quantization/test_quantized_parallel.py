"""Quantized checkpoints split over ranks. Loading only (no collective): each of two tensor-parallel
ranks holds exactly its rows / columns of every quantized weight (block FP8, online w8a8, GPTQ and AWQ
int4, msModelSlim W8A8), its whole experts under expert parallel (msModelSlim W4A8), its layers'
records only at pipeline stage 1, and an expert-parallel rank reads only its experts' tensors; a cut that misses the scale blocks names the model, the weight and
its shape. Then greedy tokens on real gloo ranks equal the same checkpoint's on one device: online
w8a8 Llama at TP 2 (row-parallel per-token scales over the whole row), block-FP8 DeepSeek-V3 and GLM-5 at TP 2
(MLA heads, experts split along their intermediate dim), W4A8 Qwen3-MoE with experts over 2 ranks,
block-FP8 Llama at PP 2. The planner's weight bytes per device (``xinserve plan``) are what a started
w8a8 rank at TP 2 holds, and what every rank loads under expert and pipeline parallel."""

from pathlib import Path
from typing import ClassVar

import pytest
import torch

from tests.engines.parallel.test_tensor_parallel import LoadOnly, RecordingSafeOpen
from tests.engines.quantization.checkpoints import fp8_blocks, write_quantized
from tests.engines.quantization.int4_checkpoints import write_int4_model
from tests.engines.quantization.modelslim_checkpoints import write_w4a8_moe, write_w8a8_dynamic
from xinserve.engines import LLM, SamplingParams
from xinserve.engines import model_loader as loader
from xinserve.engines.core.capacity import Layout, plan
from xinserve.engines.model_loader import load_model
from xinserve.engines.quantization.experts import QuantExperts
from xinserve.engines.quantization.install import weights_report
from xinserve.engines.quantization.linear import QuantLinear
from xinserve.kernels.quantized_weight import dequantize

CPU = torch.device("cpu")
PROMPTS = [[1, 17, 42, 99, 7, 250], [1, 5, 300, 12, 8, 8, 31]]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def fp8_config(block: int) -> dict:
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [block, block]}


@pytest.fixture(scope="module")
def quantized(tiny_models, tmp_path_factory):
    """``get(kind) -> (path, quantization option)``, each checkpoint written once."""
    built: dict[str, tuple[Path, str | None]] = {}

    def get(kind: str) -> tuple[Path, str | None]:
        if kind not in built:
            root = tmp_path_factory.mktemp(kind)
            llama = Path(tiny_models("llama"))
            if kind.startswith("fp8_"):  # fp8_<arch>_<block>
                arch, block = kind[4:].rsplit("_", 1)
                write_quantized(Path(tiny_models(arch)), root / "q", root / "oracle",
                                fp8_blocks((int(block), int(block))), fp8_config(int(block)))
                built[kind] = (root / "q", None)
            elif kind == "w8a8":
                built[kind] = (llama, "w8a8")
            elif kind in ("gptq", "awq"):
                built[kind] = (write_int4_model(llama, root / "q", kind, group_size=16)[0], None)
            elif kind == "modelslim_w8a8":
                built[kind] = (write_w8a8_dynamic(llama, root / "q"), None)
            else:  # modelslim_w4a8_moe
                built[kind] = (write_w4a8_moe(Path(tiny_models("qwen3_moe")), root / "q")[0], None)
        return built[kind]

    return get


def dense(module: QuantLinear) -> torch.Tensor:
    """The module's weight as it computes with it: [out, in] float32."""
    return torch.cat([dequantize(w) for w in module.weights])


@pytest.mark.parametrize("kind", ["fp8_llama_32", "w8a8", "gptq", "awq", "modelslim_w8a8"])
def test_each_tensor_parallel_rank_holds_its_part_of_every_quantized_weight(quantized, kind: str) -> None:
    path, scheme = quantized(kind)
    whole, _ = load_model(str(path), None, CPU, quantization=scheme)
    attn, mlp = whole.model.layers[1].self_attn, whole.model.layers[1].mlp
    q, kv, inter = attn.q_size, attn.kv_size, mlp.down_proj.in_features
    qkv, gate_up = dense(attn.qkv_proj), dense(mlp.gate_up_proj)  # [q + 2kv, Hd], [2I, Hd]
    for rank in range(2):
        model, _ = load_model(str(path), None, CPU, quantization=scheme, group=LoadOnly(rank, 2))
        attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
        assert isinstance(attn.qkv_proj, QuantLinear) and isinstance(mlp.down_proj, QuantLinear)
        lq, lkv, li = q // 2, kv // 2, inter // 2
        want_qkv = torch.cat([qkv[rank * lq : (rank + 1) * lq], qkv[q + rank * lkv : q + (rank + 1) * lkv],
                              qkv[q + kv + rank * lkv : q + kv + (rank + 1) * lkv]])
        torch.testing.assert_close(dense(attn.qkv_proj), want_qkv, rtol=0, atol=0)
        torch.testing.assert_close(dense(attn.o_proj), dense(whole.model.layers[1].self_attn.o_proj)[
            :, rank * lq : (rank + 1) * lq], rtol=0, atol=0)
        want_gate_up = torch.cat([gate_up[rank * li : (rank + 1) * li], gate_up[inter + rank * li : inter + (rank + 1) * li]])
        torch.testing.assert_close(dense(mlp.gate_up_proj), want_gate_up, rtol=0, atol=0)
        torch.testing.assert_close(dense(mlp.down_proj), dense(whole.model.layers[1].mlp.down_proj)[
            :, rank * li : (rank + 1) * li], rtol=0, atol=0)
        assert attn.o_proj.group is not None and attn.qkv_proj.group is None
        if scheme == "w8a8":  # row-parallel: the whole row's per-token scale, applied before the kernel
            assert attn.o_proj.row_activation.activation == "int8_per_token"
            assert {w.activation for w in attn.o_proj.weights} == {"none"}


def test_experts_over_two_ranks_hold_whole_quantized_experts(quantized) -> None:
    path, _ = quantized("modelslim_w4a8_moe")
    whole, _ = load_model(str(path), None, CPU)
    w13, w2 = whole.model.layers[1].mlp.experts.weights
    for rank in range(2):
        model, _ = load_model(str(path), None, CPU, group=LoadOnly(rank, 2), expert_parallel=True)
        experts = model.model.layers[1].mlp.experts
        assert isinstance(experts, QuantExperts) and experts.dispatch is not None
        mine = slice(4 * rank, 4 * rank + 4)  # 8 experts, contiguous placement
        assert torch.equal(experts.weights[0].qweight, w13.qweight[mine])
        assert torch.equal(experts.weights[1].scale, w2.scale[mine])


class CountingSafeOpen(RecordingSafeOpen):
    """safe_open that counts the bytes of every whole tensor read (``get_tensor``), by name."""

    reads: ClassVar[dict[str, int]] = {}

    def get_tensor(self, name):
        tensor = self.handle.get_tensor(name)
        CountingSafeOpen.reads[name] = tensor.numel() * tensor.element_size()
        return tensor


def test_an_expert_parallel_rank_reads_only_its_experts_tensors(quantized, monkeypatch) -> None:
    """Bytes read, not held: each of 2 ranks reads half the routed experts' tensors (weights, scales,
    offsets) and nothing of the other rank's experts."""
    path, _ = quantized("modelslim_w4a8_moe")
    monkeypatch.setattr(loader, "safe_open", CountingSafeOpen)
    load_model(str(path), None, CPU)
    every = dict(CountingSafeOpen.reads)
    experts = sum(n for name, n in every.items() if ".experts." in name)
    for rank in range(2):
        CountingSafeOpen.reads = {}
        load_model(str(path), None, CPU, group=LoadOnly(rank, 2), expert_parallel=True)
        read = CountingSafeOpen.reads
        assert {int(name.split(".experts.")[1].split(".")[0]) for name in read if ".experts." in name} == set(
            range(4 * rank, 4 * rank + 4))
        assert sum(n for name, n in read.items() if ".experts." in name) == experts // 2
        assert sum(read.values()) == sum(every.values()) - experts // 2


def test_a_pipeline_stage_keeps_only_its_layers_records(quantized) -> None:
    from xinserve.engines.parallel.pipeline_parallel import PipelineStage, StageLayout

    path, _ = quantized("gptq")
    model, _ = load_model(str(path), None, CPU, pipeline=PipelineStage(None, StageLayout.of(1, 1, 2)))
    assert isinstance(model.model.layers[1].self_attn.qkv_proj, QuantLinear)
    assert not any(isinstance(m, QuantLinear) for m in model.model.layers[0].modules())


def test_a_cut_that_misses_the_scale_blocks_names_the_model_weight_and_shape(quantized) -> None:
    path, _ = quantized("fp8_deepseek_v3_32")  # q_b_proj: 4 heads x 24 rows, rank 1 from row 48
    with pytest.raises(ValueError, match=r"model DeepseekV3ForCausalLM at .*: quantized weight "
                                         r"model\.layers\.0\.self_attn\.q_b_proj\.weight \(96 x 48, scale blocks "
                                         r"32 x 32\) cannot be split over the ranks: rows \[48, 96\) of 96 does not "
                                         r"fall on the scale blocks of 32"):
        load_model(str(path), None, CPU, group=LoadOnly(1, 2))


def held_bytes(model: torch.nn.Module) -> int:
    """What a rank's weights hold: its float parameters and what its quant kernels keep."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) + weights_report(model)["quantized_bytes"]


def _greedy(path: Path, scheme: str | None, **parallel) -> tuple[list[list[int]], int]:
    """The greedy tokens, and the bytes rank 0 (this process) holds. The reference quant_linear keeps
    the records as loaded (the CPU's fastest candidate may keep them dequantized)."""
    with LLM(model=str(path), quantization=scheme, num_kv_blocks=64, max_model_len=128,
             kernels={"quant_linear": "reference"}, **parallel) as llm:
        return [out.token_ids for out in llm.generate(PROMPTS, GREEDY)], held_bytes(llm.engine.runner.model)


@pytest.mark.parametrize(("kind", "parallel"), [
    ("w8a8", {"tensor_parallel_size": 2}),
    ("fp8_deepseek_v3_16", {"tensor_parallel_size": 2}),
    ("fp8_glm_moe_dsa_16", {"tensor_parallel_size": 2}),  # GLM-5: MLA + the DSA indexer, replicated
    ("modelslim_w4a8_moe", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
    ("fp8_llama_32", {"pipeline_parallel_size": 2}),
])
def test_two_ranks_generate_what_one_device_generates(quantized, kind: str, parallel: dict) -> None:
    path, scheme = quantized(kind)
    tokens, held = _greedy(path, scheme, **parallel)
    assert tokens == _greedy(path, scheme)[0]
    if kind == "w8a8":  # the planner's bytes per device are what a started rank holds
        layout = Layout(tp=parallel.get("tensor_parallel_size", 1))
        assert plan(str(path), layout=layout, quantization="w8a8").weight_bytes_per_device == held


@pytest.mark.parametrize(("arch", "layout"), [
    ("qwen3_moe", Layout(tp=2, ep=True)), ("deepseek_v3", Layout(tp=2, ep=True)), ("llama", Layout(pp=2)),
])
def test_the_plan_holds_what_every_rank_loads(tiny_models, arch: str, layout: Layout) -> None:
    """w8a8 (int8 per output channel): routers, MLA's kv_b_proj, embeddings and norms stay float; a
    pipeline's embedding and LM head on stage 0; the planned bytes are the largest rank's."""
    from xinserve.engines.parallel.pipeline_parallel import PipelineStage, StageLayout

    path = str(tiny_models(arch))
    held = []
    for rank in range(layout.devices):
        where = ({"pipeline": PipelineStage(None, StageLayout.of(rank, 1, layout.pp))} if layout.pp > 1
                 else {"group": LoadOnly(rank, layout.tp), "expert_parallel": layout.ep})
        held.append(held_bytes(load_model(path, None, CPU, quantization="w8a8", **where)[0]))
    assert plan(path, layout=layout, quantization="w8a8").weight_bytes_per_device == max(held)
