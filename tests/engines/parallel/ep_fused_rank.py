"""One rank of test_expert_parallel_fused's two-process check (a light module: a spawned process imports
it without the engine or transformers): the MoE dispatch through the fake Ascend fused exchange and
through the all-to-all reference, on the same inputs."""

import sys
from pathlib import Path

import torch

from xinserve.engines.models.expert_parallel import ExpertParallelDispatch, ExpertPlacement, make_exchange
from xinserve.engines.parallel.distributed import ParallelGroup, open_store
from xinserve.kernels.references import dense as reference
from xinserve.kernels.routing import MoeRouting

FAKES = Path(__file__).resolve().parents[2] / "fakes"


def run_rank(rank: int, port: int, placement: ExpertPlacement, queue) -> None:
    """For 1 token (rank 1's chunk is empty) and 7, in bfloat16: (rank, tokens, fused, all-to-all,
    reference over all experts); then the fused exchange's communicator name and its refusal of float32."""
    sys.path.insert(0, str(FAKES))  # torch_npu is the fake in this process
    # The real torch_npu's import names torch's privateuse1 device type "npu"; the fakes leave that
    # to a process of its own (it cannot be undone, and torch_musa's fake would want the same slot).
    torch.utils.rename_privateuse1_backend("npu")
    experts, hidden, inter, k = len(placement.order), 32, 16, 3
    routing = MoeRouting(top_k=k, scoring="softmax", renormalize=True)
    store = open_store(rank, 2, "127.0.0.1", port, 30)
    group = ParallelGroup(rank, 2, "gloo", torch.device("cpu"), store, 30, 30)
    local = placement.local_experts(rank)
    fused = ExpertParallelDispatch(reference.fused_moe, placement, group,
                                   make_exchange("npu_moe_dispatch", group, experts))
    all_to_all = ExpertParallelDispatch(reference.fused_moe, placement, group)
    try:
        for tokens in (1, 7):
            torch.manual_seed(tokens)  # the same inputs on both ranks
            x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
            w13 = torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16) / 4
            w2 = torch.randn(experts, hidden, inter, dtype=torch.bfloat16) / 4
            weights, ids = reference.select_experts(torch.randn(tokens, experts), routing)
            got = fused(x, w13[local], w2[local], weights, ids)
            want = all_to_all(x, w13[local], w2[local], weights, ids)
            queue.put((rank, tokens, got, want, reference.fused_moe(x, w13, w2, weights, ids)))
        try:  # the operators take float16 / bfloat16 only; both ranks refuse before any exchange
            fused(x.float(), w13[local].float(), w2[local].float(), weights, ids)
            refusal = None
        except RuntimeError as exc:
            refusal = str(exc)
        queue.put((rank, 0, fused.exchange.name, refusal, None))
    finally:
        group.close()
