"""The MLA ops in the kernel registry: MLA prefill is a registry op like the others, so a candidate is
probed against kernels/references/mla.py (a wrong one is rejected with its error), and the model's
prefill runs whatever the registry chose."""

import torch

from tests.kernels.test_registry import fake_module
from xinserve.engines import LLM, SamplingParams
from xinserve.kernels import registry
from xinserve.kernels.probes.checks import PROBES, TOLERANCE, ModelShapes, applies, probe
from xinserve.kernels.references import mla as mla_reference
from xinserve.kernels.routing import MoeRouting

CPU = torch.device("cpu")
# tests/engines/models/test_mla.py's tiny DSA model's attention: kv_lora_rank 32, qk_rope_head_dim 8, dn = dv = 16
SHAPES = ModelShapes(
    num_heads=4, num_kv_heads=1, head_dim=8, rotary_dim=8, rope_is_neox=False, hidden_size=64,
    intermediate_size=64, vocab_size=300, block_size=4, num_experts=8, moe_intermediate_size=16,
    moe_routing=MoeRouting(top_k=2, scoring="sigmoid", renormalize=True, num_groups=2, topk_groups=1,
                           correction_bias=True),
    kv_lora_rank=32, qk_rope_head_dim=8, mla_up_head_dims=(16, 16), index_topk=12, index_n_heads=2,
    index_head_dim=16,
)
MLA_OPS = ("write_latent", "mla_decode_attention", "mla_prefill_attention", "indexer_topk")


def off_by_a_little(*args, **kwargs) -> torch.Tensor:
    return mla_reference.mla_prefill_attention(*args, **kwargs) + 0.1


def copy_of_reference(*args, **kwargs) -> torch.Tensor:
    return mla_reference.mla_prefill_attention(*args, **kwargs).clone()


def test_every_mla_op_has_a_probe_that_accepts_the_reference_itself():
    assert all(op in PROBES and applies(op, SHAPES) for op in MLA_OPS)
    for op in MLA_OPS:
        functions = {name: mla_reference.OPS[name] for name in registry.OP_FUNCTIONS[op]}
        for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, TOLERANCE[torch.bfloat16])):
            assert probe(op, functions, SHAPES, CPU, dtype) <= tolerance, (op, dtype)


def test_a_wrong_mla_prefill_candidate_is_rejected_and_a_correct_one_chosen(monkeypatch):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    fake_module("off", monkeypatch, OPS={"mla_prefill_attention": off_by_a_little})
    fake_module("good", monkeypatch, OPS={"mla_prefill_attention": copy_of_reference})
    selection = registry.select(("off", "good", "reference"), CPU, torch.float32, SHAPES)
    assert dict(selection.rejected["mla_prefill_attention"])["off"].startswith("max abs err 1.0e-01")
    assert selection.chosen["mla_prefill_attention"] == "good"
    assert selection.ops.mla_prefill_attention is copy_of_reference


def test_the_mla_model_prefills_through_the_chosen_implementation(tiny_models, monkeypatch):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    calls = []

    def counting(query: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        calls.append(tuple(query.shape))
        return mla_reference.mla_prefill_attention(query, *args, **kwargs)

    fake_module("counting", monkeypatch, OPS={"mla_prefill_attention": counting})
    path = tiny_models("deepseek_v3")
    forced = LLM(path, num_kv_blocks=64, block_size=4, kernels={"mla_prefill_attention": "counting"})
    probed = len(calls)
    assert probed >= 1  # the start-up probe
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    plain = LLM(path, num_kv_blocks=64, block_size=4)
    assert forced.generate([[5, 6, 7, 8, 9]], params)[0].token_ids == plain.generate([[5, 6, 7, 8, 9]],
                                                                                    params)[0].token_ids
    assert len(calls) > probed
    assert forced.engine.runner.kernels.chosen["mla_prefill_attention"] == "counting"


def test_a_dense_model_never_probes_the_mla_prefill():
    dense = ModelShapes(num_heads=6, num_kv_heads=2, head_dim=8, rotary_dim=8, rope_is_neox=True, hidden_size=48,
                        intermediate_size=40, vocab_size=100, block_size=4)
    assert not applies("mla_prefill_attention", dense)
