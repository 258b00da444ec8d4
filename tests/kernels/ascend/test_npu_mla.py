"""The Ascend MLA / DSA candidates (kernels/ascend/mla.py) through the fake torch_npu: each equals the
reference on DeepSeek-shaped inputs, the registry chooses them for an MLA / DSA model on an "npu"
platform and declines the shapes and dtypes the operators refuse.

Nothing here runs on an NPU (see tests/kernels/ascend/test_npu.py)."""

from dataclasses import replace

import pytest
import torch

from xinserve.engines.platforms.npu import KERNEL_PREFERENCE as NPU_KERNELS
from xinserve.kernels import registry
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.probes.checks import TOLERANCE, probe
from xinserve.kernels.routing import MoeRouting

CPU = torch.device("cpu")
MLA_OPS = ("write_latent", "mla_decode_attention", "indexer_topk")
# DeepSeek-V3.2 / GLM-5's attention shapes with fewer heads: kv_lora_rank 512, qk_rope_head_dim 64,
# an indexer of 128-wide heads keeping 64 positions (the real 2048 needs longer probe contexts)
SHAPES = ModelShapes(
    num_heads=16, num_kv_heads=1, head_dim=64, rotary_dim=64, rope_is_neox=False, hidden_size=256,
    intermediate_size=256, vocab_size=300, block_size=128, num_experts=8, moe_intermediate_size=64,
    moe_routing=MoeRouting(top_k=2, scoring="sigmoid", renormalize=True, num_groups=2, topk_groups=1,
                           correction_bias=True),
    kv_lora_rank=512, qk_rope_head_dim=64, index_topk=64, index_n_heads=8, index_head_dim=128,
)


@pytest.fixture
def no_forced_kernels(monkeypatch) -> None:
    monkeypatch.delenv(registry.ENV_VAR, raising=False)


@pytest.mark.parametrize("op", MLA_OPS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_each_candidate_equals_the_reference(npu, op, dtype):
    functions = {name: npu.OPS[name] for name in registry.OP_FUNCTIONS[op]}
    assert probe(op, functions, SHAPES, CPU, dtype) <= TOLERANCE[dtype]


def test_the_registry_chooses_them_for_a_dsa_model(npu, no_forced_kernels):
    selection = registry.select(NPU_KERNELS, CPU, torch.bfloat16, SHAPES)
    assert {op: selection.chosen[op] for op in MLA_OPS} == dict.fromkeys(MLA_OPS, "npu"), selection.rejected
    assert selection.ops.mla_decode_attention is npu.OPS["mla_decode_attention"]


def test_the_registry_declines_what_the_operators_refuse(npu, no_forced_kernels):
    tiny = replace(SHAPES, kv_lora_rank=32, qk_rope_head_dim=8, index_head_dim=16, index_n_heads=16, index_topk=12)
    selection = registry.select(NPU_KERNELS, CPU, torch.bfloat16, tiny)
    reasons = {op: dict(selection.rejected.get(op, [])).get("npu") for op in MLA_OPS}
    assert reasons["mla_decode_attention"] == "kv_lora_rank 32 / qk_rope_head_dim 8 unsupported (512 / 64 only)"
    assert reasons["indexer_topk"].startswith("index_head_dim 16")
    assert selection.chosen["mla_decode_attention"] == selection.chosen["indexer_topk"] == "reference"
    float32 = registry.select(NPU_KERNELS, CPU, torch.float32, SHAPES)
    assert {float32.chosen[op] for op in MLA_OPS} == {"reference"}
    # a model without MLA never probes them: the reference stays, unprobed and unreported
    dense = replace(SHAPES, kv_lora_rank=0, qk_rope_head_dim=0, index_topk=0)
    selection = registry.select(NPU_KERNELS, CPU, torch.bfloat16, dense)
    assert {selection.chosen[op] for op in MLA_OPS} == {"reference"}
    assert not any(op in selection.rejected for op in MLA_OPS)


def test_the_fake_refuses_what_the_operators_refuse(npu):
    fake = npu.torch_npu
    latent = torch.zeros(2, 128, 576, dtype=torch.bfloat16)
    query = torch.zeros(1, 16, 512)  # float32: the MLA attention takes half precision only
    with pytest.raises(RuntimeError, match="aclnnFusedInferAttentionScore"):
        fake.npu_fused_infer_attention_score(
            query, latent[..., :512].unsqueeze(2), latent[..., :512].unsqueeze(2), query_rope=torch.zeros(1, 16, 64),
            key_rope=latent[..., 512:].unsqueeze(2), num_heads=16, num_key_value_heads=1, input_layout="TND",
            scale=1.0, sparse_mode=0, block_table=torch.zeros(1, 1, dtype=torch.int32), block_size=128,
            actual_seq_lengths=[1], actual_seq_lengths_kv=[5],
        )
    with pytest.raises(RuntimeError, match="aclnnScatterNdUpdate"):  # int16 row indices
        fake.npu_scatter_nd_update_(latent.view(-1, 576), torch.zeros(1, 1, dtype=torch.int16),
                                    torch.zeros(1, 576, dtype=torch.bfloat16))
