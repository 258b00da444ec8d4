"""One rank of test_expert_parallel's two-process dispatch check (a light module: a spawned process
imports it without the engine or transformers)."""

import torch

from xinserve.engines.models.expert_parallel import ExpertParallelDispatch, ExpertPlacement
from xinserve.engines.parallel.distributed import ParallelGroup, open_store
from xinserve.kernels.references import dense as reference
from xinserve.kernels.routing import MoeRouting


def run_rank(rank: int, port: int, placement: ExpertPlacement, queue) -> None:
    """The dispatch over a gloo group of two for 1 token (rank 1 gets no token of the chunk split)
    and for 7, with the reference over all experts; then the group's collective counts."""
    experts, hidden, inter, k = len(placement.order), 16, 8, 3
    routing = MoeRouting(top_k=k, scoring="softmax", renormalize=True)
    store = open_store(rank, 2, "127.0.0.1", port, 30)
    group = ParallelGroup(rank, 2, "gloo", torch.device("cpu"), store, 30, 30)
    local = placement.local_experts(rank)
    dispatch = ExpertParallelDispatch(reference.fused_moe, placement, group)
    try:
        for tokens in (1, 7):
            torch.manual_seed(tokens)  # the same inputs on both ranks
            x = torch.randn(tokens, hidden)
            w13, w2 = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
            weights, ids = reference.select_experts(torch.randn(tokens, experts), routing)
            got = dispatch(x, w13[local], w2[local], weights, ids)
            queue.put((rank, tokens, got, reference.fused_moe(x, w13, w2, weights, ids)))
        queue.put((rank, 0, dict(group.counts), None))
    finally:
        group.close()
