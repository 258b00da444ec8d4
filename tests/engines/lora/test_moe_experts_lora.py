"""LoRA on the routed experts, as PEFT writes it (``target_parameters`` on ``mlp.experts.gate_up_proj`` /
``down_proj``, or ``target_modules`` gate/up/down_proj that PEFT converts to them): greedy outputs equal
transformers + PEFT token for token on a tiny Qwen3-MoE (a dense first layer) and Mixtral, with an
attention + experts adapter, a converted one, an attention-only one, an experts-only one (four adapters on
three slots) and base rows in one batch of 20 prompts under preemption; what is still not served is refused by name."""

import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engines.lora.conftest import PeftReference, edit_config
from xinserve.engines import LLM, SamplingParams
from xinserve.engines.lora.device_adapters import DeviceAdapters
from xinserve.engines.lora.peft_checkpoint import read_adapter
from xinserve.engines.lora.targets import ModelTargets
from xinserve.engines.model_loader import load_model
from xinserve.engines.models.moe import SparseMoeBlock
from xinserve.engines.models.tensor_parallel import ParallelExperts
from xinserve.kernels.ops import REFERENCE_OPS

MAX_TOKENS = 6
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ADAPTERS = {  # name -> (rank, PEFT config)
    "experts": (4, {"targets": ATTENTION, "target_parameters": EXPERTS}),
    # PEFT converts these to target_parameters on the experts (gate_up's rank doubled in rank_pattern), and keeps
    # them as modules on the dense layer
    "converted": (4, {"targets": ["v_proj", "gate_proj", "up_proj", "down_proj"], "use_rslora": True}),
    "attention": (8, {"targets": ATTENTION}),
    "experts_only": (4, {"targets": None, "target_parameters": EXPERTS}),
}


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def setup(request, tiny_models, adapters):
    arch = request.param
    configs = {name: config for name, (_, config) in ADAPTERS.items()}
    if arch == "mixtral":  # transformers 4's Mixtral named the experts' gate, down and up w1, w2, w3
        configs["converted"] = {**configs["converted"], "targets": ["v_proj", "w1", "w3", "w2"]}
    paths = {name: adapters(arch, rank, seed=40 + i, **configs[name])
             for i, (name, (rank, _)) in enumerate(ADAPTERS.items())}
    return tiny_models(arch), paths, PeftReference(tiny_models(arch), paths, MAX_TOKENS)


def test_expert_adapters_mixed_with_attention_only_and_base_rows_match_peft(setup):
    base, paths, reference = setup
    rng = random.Random(11)
    prompts = [[rng.randrange(3, reference.vocab_size) for _ in range(rng.randint(3, 20))] for _ in range(20)]
    names = [[None, *ADAPTERS][i % 5] for i in range(20)]
    with LLM(base, enable_lora=True, max_loras=3, max_lora_rank=8, num_kv_blocks=30, block_size=4,
             max_num_batched_tokens=32, lora_modules={n: str(p) for n, p in paths.items()}) as llm:
        results = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, lora_name=n)
                                         for n in names])
        stats = llm.engine.stats()
    for prompt, name, result in zip(prompts, names, results):
        assert result.outputs[0].token_ids == reference.generate(prompt, name), f"adapter {name} diverged"
    assert stats.num_preemptions_total > 0
    # the experts' LoRA alone changes what the model says (prompts 0 and 4 ran on the base and experts_only)
    assert reference.generate(prompts[0], "experts_only") != results[0].outputs[0].token_ids
    assert reference.generate(prompts[4], None) != results[4].outputs[0].token_ids


def test_each_experts_delta_is_peft_s_per_expert_factors(setup):
    """PEFT's lora_A [E * r, in] holds expert e's rows [e * r, (e + 1) * r), lora_B [out, r * E] its columns
    e, e + E, ...: the host copy is (A [E, r, in], B [E, out, r]) with alpha / r folded into B."""
    base, paths, _ = setup
    model, _ = load_model(str(base), torch.float32, torch.device("cpu"))
    targets = ModelTargets.of(model)
    adapter = read_adapter(str(paths["experts"]), targets, max_lora_rank=8)
    raw = load_file(str(paths["experts"] / "adapter_model.safetensors"))
    layer = min(targets.expert_layers)
    a, b = adapter.modules[f"layers.{layer}.mlp.experts.down_proj"]
    peft_a = raw[f"base_model.model.model.layers.{layer}.mlp.experts.lora_A.weight"]
    peft_b = raw[f"base_model.model.model.layers.{layer}.mlp.experts.lora_B.weight"]
    num_experts, rank = targets.num_experts, 4
    expert = num_experts - 1
    torch.testing.assert_close(a[expert], peft_a[expert * rank : (expert + 1) * rank])
    torch.testing.assert_close(b[expert], peft_b[:, expert::num_experts] * 2.0)  # alpha 2r / r
    gate_up_a, _ = adapter.modules[f"layers.{layer}.mlp.experts.gate_up_proj"]
    assert gate_up_a.shape == (num_experts, rank, model.config.hidden_size)  # the wrapped (inner) parameter


def test_unserved_expert_targets_are_refused_by_name(tiny_models, adapters, tmp_path):
    base = tiny_models("qwen3_moe")
    model, _ = load_model(str(base), torch.float32, torch.device("cpu"))
    targets = ModelTargets.of(model)
    experts = adapters("qwen3_moe", 4, seed=40, **ADAPTERS["experts"][1])
    with pytest.raises(ValueError, match="gate_up_proj has rank 8, more than max_lora_rank 4"):
        read_adapter(str(adapters("qwen3_moe", 4, seed=41, **ADAPTERS["converted"][1])), targets, max_lora_rank=4)
    router = shutil.copytree(experts, tmp_path / "router")
    edit_config(router, target_parameters=["mlp.gate.weight", *EXPERTS])
    with pytest.raises(ValueError, match="target_parameters 'mlp.gate.weight' is not served"):
        read_adapter(str(router), targets, max_lora_rank=8)
    # a third wrapper (more saved parameters than target_parameters names)
    nested = shutil.copytree(experts, tmp_path / "nested")
    tensors = load_file(str(nested / "adapter_model.safetensors"))
    layer = min(targets.expert_layers)
    prefix = f"base_model.model.model.layers.{layer}.mlp.experts"
    tensors[f"{prefix}.base_layer.base_layer.lora_A.weight"] = tensors[f"{prefix}.lora_A.weight"].clone()
    save_file(tensors, str(nested / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="does not fit its target_parameters"):
        read_adapter(str(nested), targets, max_lora_rank=8)
    # expert weights of another base model (fewer experts)
    other = adapters("qwen3_moe", 4, seed=40, **ADAPTERS["experts"][1])
    wrong = ModelTargets.of(load_model(str(tiny_models("qwen3_moe", num_experts=4)), torch.float32,
                                       torch.device("cpu"))[0])
    with pytest.raises(ValueError, match="down_proj has lora_A .32, 32. .*4 experts at rank 4 need .16, 32."):
        read_adapter(str(other), wrong, max_lora_rank=8)


def test_expert_adapters_are_refused_on_tensor_parallel_experts_and_attention_still_served(tiny_models, adapters):
    """A rank's share of the experts (tensor parallel; expert parallel and quantized experts are other types
    too) gets no expert stacks: expert adapters are refused by name, attention ones still load."""
    base = tiny_models("qwen3_moe")
    model, config = load_model(str(base), torch.float32, torch.device("cpu"))
    for layer in model.model.layers:
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp.experts = ParallelExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                                rank=0, tp=2)
    slots = DeviceAdapters(model, max_loras=1, max_rank=8, max_rows=16, ops=REFERENCE_OPS)
    assert not slots.serves_experts
    with pytest.raises(ValueError, match="experts are tensor-parallel, expert-parallel or quantized here"):
        slots.load(1, str(adapters("qwen3_moe", 4, seed=40, **ADAPTERS["experts"][1])))
    attention = slots.load(2, str(adapters("qwen3_moe", 8, seed=42, **ADAPTERS["attention"][1])))
    assert len(attention.modules) == 4 * model.num_layers
