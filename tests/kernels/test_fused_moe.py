"""The fused_moe op (``select_experts`` + ``fused_moe``): the reference against plain per-token math
written out here, the torch._grouped_mm and Ascend implementations against the reference, the fake
torch_npu MoE operators refusing what the real ones refuse, the registry's choices for MoE models,
and a whole greedy generation of MoE models on the npu path equal to the CPU path."""

import random
from dataclasses import replace

import pytest
import torch

import xinserve.engines.core.engine
from xinserve.engines import LLM, SamplingParams
from xinserve.engines.platforms import npu as ascend
from xinserve.engines.platforms.npu import KERNEL_PREFERENCE as NPU_KERNELS
from xinserve.kernels import registry
from xinserve.kernels.cuda import grouped_mm
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.probes.checks import TOLERANCE, max_error
from xinserve.kernels.references import dense as reference
from xinserve.kernels.routing import MoeRouting

CPU = torch.device("cpu")
SOFTMAX = MoeRouting(top_k=2)
SOFTMAX_UNNORMALISED = MoeRouting(top_k=4, renormalize=False)
GROUPED_SIGMOID = MoeRouting(top_k=2, scoring="sigmoid", num_groups=4, topk_groups=2, correction_bias=True,
                             scaling_factor=2.5)
ROUTINGS = {"softmax": SOFTMAX, "softmax-top4-unnormalised": SOFTMAX_UNNORMALISED, "grouped-sigmoid": GROUPED_SIGMOID}


def experts(num_experts: int, hidden: int, inter: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, Hd], w2 [E, Hd, I], scaled to keep activations of order one."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5
    return w13, w2


def routed(tokens: int, num_experts: int, routing: MoeRouting, seed: int):
    """Random router logits (and bias) through the reference routing: (logits, bias, weights, ids)."""
    gen = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(tokens, num_experts, generator=gen)
    bias = 0.1 * torch.randn(num_experts, generator=gen) if routing.correction_bias else None
    return logits, bias, *reference.select_experts(logits, routing, bias)


def per_token_loop(hidden, w13, w2, weights, ids) -> torch.Tensor:
    """Each token through each of its experts, one vector at a time, in float64."""
    inter = w2.shape[2]
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        x = hidden[t].double()
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = w13[e, :inter].double() @ x, w13[e, inter:].double() @ x
            out[t] += float(weights[t, k]) * (w2[e].double() @ (gate * torch.sigmoid(gate) * up))
    return out


# ---- the reference ----

@pytest.mark.parametrize("tokens, num_experts, routing", [
    (1, 8, SOFTMAX),  # a decode step of one sequence: 6 of 8 experts idle
    (13, 6, SOFTMAX),
    (5, 16, SOFTMAX_UNNORMALISED),  # 20 rows over 16 experts: several get none
    (9, 16, GROUPED_SIGMOID),
])
def test_reference_fused_moe_equals_a_plain_per_token_loop(tokens, num_experts, routing):
    w13, w2 = experts(num_experts, 24, 10, seed=tokens)
    hidden = torch.randn(tokens, 24, generator=torch.Generator().manual_seed(1))
    *_, weights, ids = routed(tokens, num_experts, routing, seed=2)
    if tokens * routing.top_k < 2 * num_experts:
        assert len(set(ids.flatten().tolist())) < num_experts  # some experts receive no token
    got = reference.fused_moe(hidden, w13, w2, weights, ids)
    assert got.shape == hidden.shape and got.dtype == hidden.dtype
    assert (got.double() - per_token_loop(hidden, w13, w2, weights, ids)).abs().max() < 1e-5


def test_softmax_routing_is_the_top_k_of_the_probabilities():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 4.0]])
    probs = logits.softmax(-1)
    weights, ids = reference.select_experts(logits, MoeRouting(top_k=2, renormalize=False))
    assert ids.tolist() == [[1, 3], [0, 3]]
    assert torch.allclose(weights, probs.gather(1, ids))
    weights, _ = reference.select_experts(logits, MoeRouting(top_k=2, scaling_factor=3.0))
    assert torch.allclose(weights.sum(-1), torch.tensor([3.0, 3.0]))


def test_grouped_sigmoid_routing_chooses_by_biased_score_in_the_best_groups():
    # 8 experts in 2 groups of 4. Group 0's two best biased scores sum higher, so both experts come
    # from it although expert 5 (group 1) has the best raw score; within group 0 the bias lifts
    # expert 2 above expert 0, and the weights are the unbiased sigmoid scores, renormalised.
    logits = torch.tensor([[1.0, -3.0, 0.9, 0.5, -3.0, 2.0, -3.0, -3.0]])
    bias = torch.tensor([0.0, 0.0, 0.2, 0.1, 0.0, 0.0, 0.0, 0.0])
    routing = MoeRouting(top_k=2, scoring="sigmoid", num_groups=2, topk_groups=1, correction_bias=True,
                         scaling_factor=2.0)
    weights, ids = reference.select_experts(logits, routing, bias)
    assert sorted(ids[0].tolist()) == [0, 2]
    scores = logits.sigmoid()[0, [0, 2]]
    expected = dict(zip([0, 2], (2.0 * scores / scores.sum()).tolist()))
    assert {int(e): float(w) for e, w in zip(ids[0], weights[0])} == pytest.approx(expected)


# ---- torch._grouped_mm ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 11])
def test_grouped_mm_equals_the_reference(dtype, tokens):
    w13, w2 = experts(8, 32, 16, seed=3)
    hidden = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(4))
    *_, weights, ids = routed(tokens, 8, SOFTMAX, seed=5)
    got = grouped_mm.fused_moe(hidden.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)
    assert got.dtype == dtype
    assert max_error(got, reference.fused_moe(hidden, w13, w2, weights, ids)) <= TOLERANCE[dtype]


def test_grouped_mm_declines_rows_that_are_not_16_byte_aligned():
    shapes = moe_shapes(SOFTMAX, hidden_size=60)
    assert grouped_mm.unsupported("fused_moe", shapes, torch.float32) is None  # 240 bytes
    assert grouped_mm.unsupported("fused_moe", shapes, torch.bfloat16) == (
        "hidden_size 60 unsupported in torch.bfloat16 (rows must be 16-byte aligned)")


# ---- Ascend, through the fake torch_npu ----

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("routing", list(ROUTINGS.values()), ids=list(ROUTINGS))
def test_npu_routing_and_experts_equal_the_reference(npu, dtype, routing):
    w13, w2 = experts(16, 64, 32, seed=6)
    hidden = torch.randn(9, 64, generator=torch.Generator().manual_seed(7))
    logits, bias, want_weights, want_ids = routed(9, 16, routing, seed=8)
    weights, ids = npu.select_experts(logits, routing, bias)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    # the same experts and weights, whatever order each token lists them in
    assert torch.equal(ids.sort(-1).values.long(), want_ids.sort(-1).values)
    assert torch.allclose(weights.sort(-1).values, want_weights.sort(-1).values, atol=1e-6)
    got = npu.fused_moe(hidden.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)
    assert got.dtype == dtype
    assert max_error(got, reference.fused_moe(hidden, w13, w2, want_weights, want_ids)) <= TOLERANCE[dtype]


def test_npu_fused_moe_of_a_single_token(npu):
    w13, w2 = experts(8, 32, 16, seed=9)
    hidden = torch.randn(1, 32, generator=torch.Generator().manual_seed(10))
    *_, weights, ids = routed(1, 8, SOFTMAX, seed=11)
    got = npu.fused_moe(hidden.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids.int())
    assert max_error(got, reference.fused_moe(hidden, w13, w2, weights, ids)) <= TOLERANCE[torch.bfloat16]


def test_the_fake_refuses_wrong_moe_arguments(npu):
    fake = npu.torch_npu
    x = torch.zeros(3, 32, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1], [1, 2], [3, 0]], dtype=torch.int32)
    routing = {"active_num": 6, "expert_num": 4, "expert_tokens_num_type": 1, "expert_tokens_num_flag": True,
               "active_expert_range": [0, 4], "quant_mode": -1}
    with pytest.raises(RuntimeError, match="MoeInitRoutingV2.*expert_idx must be .* int32"):
        fake.npu_moe_init_routing_v2(x, ids.long(), **routing)
    expanded, row_map, counts, _ = fake.npu_moe_init_routing_v2(x, ids, **routing)
    assert counts.tolist() == [2, 2, 1, 1] and row_map.dtype == torch.int32
    weight = torch.zeros(4, 16, 32, dtype=torch.bfloat16)  # [E, N, K]: passed transposed is fine
    grouped = {"split_item": 2, "group_type": 0, "group_list_type": 1, "group_list": counts}
    assert fake.npu_grouped_matmul([expanded], [weight.transpose(1, 2)], **grouped)[0].shape == (6, 16)
    with pytest.raises(TypeError, match="must be lists of tensors"):
        fake.npu_grouped_matmul(expanded, [weight.transpose(1, 2)], **grouped)
    with pytest.raises(RuntimeError, match="GroupedMatmul.*weight must be 3-D torch.bfloat16"):
        fake.npu_grouped_matmul([expanded], [weight.transpose(1, 2).float()], **grouped)
    with pytest.raises(RuntimeError, match="GroupedMatmul.*strides .* are neither ND nor transposed ND"):
        fake.npu_grouped_matmul([expanded], [weight.transpose(1, 2)[:, ::2]], **grouped)
    with pytest.raises(RuntimeError, match="GroupedMatmul.*does not split the 6 rows"):
        fake.npu_grouped_matmul([expanded], [weight.transpose(1, 2)], **{**grouped, "group_list": counts + 1})
    with pytest.raises(RuntimeError, match="MoeTokenUnpermute.*probs must be .* torch.bfloat16"):
        fake.npu_moe_token_unpermute(expanded, row_map, probs=torch.ones(3, 2))
    with pytest.raises(RuntimeError, match="MoeGatingTopK.*k 5 / k_group 1 out of range"):
        fake.npu_moe_gating_top_k(torch.zeros(2, 8), k=5, k_group=1, group_count=2, group_select_mode=1)


# ---- the registry ----

def moe_shapes(routing: MoeRouting, hidden_size: int = 64, num_experts: int = 8, block_size: int = 128) -> ModelShapes:
    return ModelShapes(num_heads=4, num_kv_heads=2, head_dim=32, rotary_dim=32, rope_is_neox=True,
                       hidden_size=hidden_size, intermediate_size=96, vocab_size=300, block_size=block_size,
                       num_experts=num_experts, moe_intermediate_size=32, moe_routing=routing)


@pytest.fixture
def no_forced_kernels(monkeypatch) -> None:
    monkeypatch.delenv(registry.ENV_VAR, raising=False)


@pytest.mark.parametrize("routing", [SOFTMAX, GROUPED_SIGMOID], ids=["softmax", "grouped-sigmoid"])
def test_the_registry_chooses_the_ascend_moe_path(npu, no_forced_kernels, routing):
    selection = registry.select(NPU_KERNELS, CPU, torch.bfloat16, moe_shapes(routing))
    assert selection.chosen["fused_moe"] == "npu", selection.rejected
    assert selection.ops.fused_moe is npu.fused_moe and selection.ops.select_experts is npu.select_experts


def test_the_registry_keeps_the_reference_where_ascend_declines(npu, no_forced_kernels):
    unnormalised = replace(GROUPED_SIGMOID, renormalize=False)
    selection = registry.select(NPU_KERNELS, CPU, torch.bfloat16, moe_shapes(unnormalised))
    assert selection.chosen["fused_moe"] == "reference"
    assert selection.rejected["fused_moe"] == [
        ("npu", "sigmoid scores without renormalisation unsupported (MoeGatingTopK always renormalises them)")]
    selection = registry.select(NPU_KERNELS, CPU, torch.bfloat16, moe_shapes(MoeRouting(top_k=2), num_experts=4096))
    assert "4096 experts in 1 groups unsupported" in dict(selection.rejected["fused_moe"])["npu"]


def test_a_dense_model_never_probes_fused_moe(no_forced_kernels, monkeypatch):
    grouped_mm_first = ("grouped_mm", "reference")
    dense = replace(moe_shapes(SOFTMAX), num_experts=0, moe_intermediate_size=0, moe_routing=None)
    selection = registry.select(grouped_mm_first, CPU, torch.float32, dense)
    assert selection.chosen["fused_moe"] == "reference" and "fused_moe" not in selection.rejected
    selection = registry.select(grouped_mm_first, CPU, torch.float32, moe_shapes(SOFTMAX))
    assert selection.chosen["fused_moe"] == "grouped_mm"


# ---- whole generations on the npu path ----

@pytest.fixture
def npu_platform(npu, no_forced_kernels, monkeypatch):
    """get_platform("npu...") answers an Ascend platform whose device is the CPU."""
    platform = replace(ascend.record(CPU), default_block_size=16, default_kv_cache_memory_fraction=0.1,
                       free_memory=lambda: 2**30, synchronize=lambda: None, dist_backend="gloo")
    real = xinserve.engines.core.engine.get_platform
    monkeypatch.setattr(xinserve.engines.core.engine, "get_platform",
                        lambda device: platform if device.startswith("npu") else real(device))


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_greedy_generation_of_moe_models_on_npu_equals_cpu(npu_platform, tiny_models, arch):
    # float32, so that the expert path is compared exactly (Ascend's attention kernels take half
    # precision only and fall back to the reference here; the MoE operators take float32 too)
    model = tiny_models(arch)
    options = {"dtype": "float32", "block_size": 16, "num_kv_blocks": 64}
    on_npu, on_cpu = LLM(model, device="npu:0", **options), LLM(model, device="cpu", **options)
    assert on_npu.engine.runner.kernels.chosen["fused_moe"] == "npu"
    rng = random.Random(3)
    prompts = [[rng.randrange(3, on_npu.engine.vocab_size) for _ in range(n)] for n in (1, 9, 30)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert [r.token_ids for r in on_npu.generate(prompts, params)] == [
        r.token_ids for r in on_cpu.generate(prompts, params)]


@pytest.mark.parametrize("impl", [reference.fused_moe, grouped_mm.fused_moe], ids=["reference", "grouped_mm"])
def test_fused_moe_traces_as_one_graph_that_no_routing_recompiles(impl):
    """Under torch.compile (the compiled decode, engines/worker/graphs.py) fused_moe is one opaque op: no graph
    break (fullgraph), and a new routing reuses the compiled graph. Before: the reference's host read
    of the per-expert counts broke the graph and its per-expert guards recompiled for every routing
    until dynamo's recompile limit; grouped_mm's bincount broke the graph."""
    w13, w2 = experts(8, 32, 16, seed=0)
    hidden = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    compiled = torch.compile(lambda *args: impl(*args) * 2, backend="eager", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(4):
            _, _, weights, ids = routed(4, 8, SOFTMAX, seed=seed)
            got = compiled(hidden, w13, w2, weights, ids)
            torch.testing.assert_close(got, reference.fused_moe(hidden, w13, w2, weights, ids) * 2)
