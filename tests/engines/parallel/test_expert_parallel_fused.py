"""Expert parallel's fused Ascend exchange (kernels/ascend/moe_dispatch.py) against the fake torch_npu:
on two CPU ranks (gloo) the MoE layer's output through ``npu_moe_distribute_dispatch`` / ``_combine``
equals the all-to-all reference's on the same inputs, under a permuted placement and with a rank
whose chunk holds no token; kernels/ep_dispatch.py picks it on the NPU platform where the documented
limits allow and names the reference, with the reasons, elsewhere."""

import importlib
import sys

import pytest
import torch

from tests.engines.parallel.ep_fused_rank import FAKES, run_rank
from tests.engines.parallel.test_expert_parallel import run_two_ranks
from xinserve import kernels
from xinserve.engines.models.expert_parallel import ExpertPlacement
from xinserve.engines.platforms import cpu, cuda, npu
from xinserve.kernels.ep_dispatch import choose_ep_dispatch
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.routing import MoeRouting

SHAPES = ModelShapes(num_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=64, rope_is_neox=True, hidden_size=2048,
                     intermediate_size=4096, vocab_size=1000, block_size=128, num_experts=64,
                     moe_intermediate_size=512, moe_routing=MoeRouting(top_k=8, scoring="softmax", renormalize=True))

CPU_EXCHANGES, CUDA_EXCHANGES, NPU_EXCHANGES = (m.EP_DISPATCH_PREFERENCE for m in (cpu, cuda, npu))


def test_fused_exchange_equals_the_all_to_all_reference():
    placement = ExpertPlacement((5, 2, 7, 0, 3, 6, 1, 4), num_ranks=2)
    names = set()
    for rank, tokens, got, want, full in run_two_ranks(run_rank, placement, 6):
        if not tokens:
            names.add(got)
            assert "aclnnMoeDistributeDispatch failed" in want and "float16 / bfloat16" in want
            continue
        assert got.dtype == torch.bfloat16 and got.shape == (tokens, 32)
        torch.testing.assert_close(got, want)  # bfloat16 tolerances
        torch.testing.assert_close(got, full)
    assert len(names) == 1 and next(iter(names)).startswith("fake_hccl_comm_")  # one communicator, both ranks


@pytest.fixture
def fake_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake torch_npu importable for this test only."""
    monkeypatch.syspath_prepend(str(FAKES))
    for name in ("torch_npu", "torch_npu.npu", "xinserve.kernels.ascend.moe_dispatch"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield
    for name in ("torch_npu", "torch_npu.npu", "torch_npu.moe_distribute", "torch_npu.mla", "torch_npu.quant",
                 "torch_npu.kv_int8", "xinserve.kernels.ascend.moe_dispatch"):
        sys.modules.pop(name, None)
    for module, attr in ((torch, "npu"), (kernels, "npu_moe_dispatch")):
        if hasattr(module, attr):
            delattr(module, attr)


def test_the_fused_exchange_is_chosen_on_npu_within_its_limits(fake_npu):
    choice = choose_ep_dispatch(NPU_EXCHANGES, 16, SHAPES, torch.bfloat16, max_num_batched_tokens=2048)
    assert (choice.chosen, choice.rejected) == ("npu_moe_dispatch", [])
    assert importlib.import_module("xinserve.kernels.ascend.moe_dispatch").torch_npu.__file__.startswith(str(FAKES))
    for ranks, dtype, tokens, reason in (
            (2, torch.bfloat16, 2048, "ep_world_size 2 unsupported"),
            (16, torch.float32, 2048, "float32 unsupported"),
            (16, torch.bfloat16, 8192, "512 tokens per rank unsupported")):
        choice = choose_ep_dispatch(NPU_EXCHANGES, ranks, SHAPES, dtype, max_num_batched_tokens=tokens)
        assert choice.chosen == "all_to_all"
        assert [(impl, r.split(" (")[0]) for impl, r in choice.rejected] == [("npu_moe_dispatch", reason)]


def test_the_reference_elsewhere():
    assert choose_ep_dispatch(CPU_EXCHANGES, 16, SHAPES, torch.bfloat16, 2048).chosen == "all_to_all"
    assert choose_ep_dispatch(CUDA_EXCHANGES, 16, SHAPES, torch.bfloat16, 2048).rejected == []
    missing = choose_ep_dispatch(NPU_EXCHANGES, 16, SHAPES, torch.bfloat16, 2048)  # no torch_npu installed here
    assert missing.chosen == "all_to_all" and missing.rejected[0][1].startswith("not installed")
