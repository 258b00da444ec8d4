"""Expert parallelism: whole routed experts per rank, tokens exchanged all-to-all.

The expert-parallel (EP) group is the tensor-parallel ranks of the replica, as in vLLM's
``--enable-expert-parallel``. ``ExpertPlacement`` is the one map of which rank holds which logical
expert, and in which local slot; a load balancer (EPLB) would permute it and reload the weights.

The hidden states reaching a MoE layer are the same on every rank (attention is tensor-parallel or
replicated), so each rank takes its own contiguous chunk of the tokens, sends every (token, expert)
pair of the chunk to the rank that holds the expert, runs its experts on what it received, sends
the results back, weights and sums them per token, and the chunks are gathered again. Per MoE layer:
three ``all_to_all_single`` (the row counts, the rows, the results) and one ``all_gather``. With
data-parallel attention (each rank its own requests) the chunking and the gather drop out: a rank's
own tokens are its chunk (docs/parallelism.md, "Expert parallel"). Where the platform has a fused dispatch / combine
(Ascend's ``npu_moe_distribute_*``, chosen by kernels/ep_dispatch.py), ``FusedExchange`` replaces the
three ``all_to_all``; the all-to-all path is its reference.

Shared experts and dense MLPs are unchanged: tensor-parallel where the model is, replicated where its
attention cannot be split (multi-head latent attention models run attention replicated under EP).
"""

import copy
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from xinserve.engines.models.moe import Experts, SparseMoeBlock
from xinserve.kernels.ep_dispatch import MODULES as EP_MODULES
from xinserve.kernels.ep_dispatch import REFERENCE as EP_REFERENCE


class ExpertCollectives(Protocol):
    """What the dispatch needs of ``xinserve.engines.parallel.distributed.ParallelGroup``."""

    rank: int
    world_size: int

    def all_to_all(self, output: torch.Tensor, x: torch.Tensor, output_splits: list[int],
                   input_splits: list[int]) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]: ...


@dataclass(frozen=True, slots=True)
class ExpertPlacement:
    """Logical expert -> (rank, local slot). ``order`` lists the logical experts in physical order:
    rank r holds ``order[r * L : (r + 1) * L]`` in its slots 0..L-1 (L = experts per rank)."""

    order: tuple[int, ...]
    num_ranks: int

    @classmethod
    def contiguous(cls, num_experts: int, num_ranks: int) -> "ExpertPlacement":
        return cls(tuple(range(num_experts)), num_ranks)

    def __post_init__(self) -> None:
        if sorted(self.order) != list(range(len(self.order))):
            raise ValueError(f"an expert placement must list every expert once, got {list(self.order)}")
        if len(self.order) % self.num_ranks:
            raise ValueError(f"{len(self.order)} routed experts do not divide by {self.num_ranks} ranks")

    @property
    def per_rank(self) -> int:
        return len(self.order) // self.num_ranks

    def local_experts(self, rank: int) -> list[int]:
        """The logical experts of ``rank``, in slot order."""
        return list(self.order[rank * self.per_rank : (rank + 1) * self.per_rank])

    def physical_index(self) -> torch.Tensor:
        """[E] int64: logical expert -> rank * L + slot."""
        index = torch.empty(len(self.order), dtype=torch.int64, device="cpu")  # not the meta device of a build
        index[list(self.order)] = torch.arange(len(self.order), device="cpu")
        return index

    def describe(self, rank: int) -> str:
        """``rank``'s experts for /health: a range "0-3" when consecutive, else a list."""
        experts = self.local_experts(rank)
        if experts == list(range(experts[0], experts[0] + len(experts))):
            return f"{experts[0]}-{experts[-1]}"
        return ",".join(map(str, experts))


class ExpertParallelExperts(Experts):
    """This rank's routed experts, whole: ``gate_up_proj`` [L, 2I, Hd], ``down_proj`` [L, Hd, I]."""

    def __init__(self, placement: ExpertPlacement, rank: int, hidden_size: int, intermediate_size: int) -> None:
        self.local = placement.local_experts(rank)
        super().__init__(len(self.local), hidden_size, intermediate_size)
        self.slots = {expert: slot for slot, expert in enumerate(self.local)}

    def slot(self, expert: int) -> int | None:
        return self.slots.get(expert)

    def read_shard(self, piece: Any, leaf: str, shard: int | None) -> torch.Tensor:
        if len(piece.get_shape()) == 3:  # every expert stacked in one checkpoint tensor: ours, in slot order
            return torch.stack([piece[e : e + 1][0] for e in self.local])
        return piece[:]  # one of our experts (another rank's is never read: tensor_parallel.read_shard)


class FusedExchange:
    """A vendor's fused dispatch / combine (kernels/ep_dispatch.py chose it) over a communicator of its
    own: the Ascend operators allow no other collective in theirs. Made once per model, before the
    meta-device build, by every rank of the replica in the same order (``new_group`` is collective):
    one communicator per EP group, global ranks ``s * ep .. (s + 1) * ep - 1`` for pipeline stage s."""

    def __init__(self, implementation: str, group: ExpertCollectives, num_experts: int) -> None:
        self.kernel = importlib.import_module(EP_MODULES[implementation])
        ep = self.world_size = group.world_size
        self.rank, self.num_experts = group.rank, num_experts
        groups = [dist.new_group(list(range(s * ep, (s + 1) * ep))) for s in range(dist.get_world_size() // ep)]
        self.name = self.kernel.hccl_comm_name(groups[dist.get_rank() // ep], group.rank)

    def __call__(self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                 run_experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], global_bs: int) -> torch.Tensor:
        return self.kernel.dispatch_combine(hidden, expert_ids, weights, run_experts, self.name, self.world_size,
                                            self.rank, self.num_experts, global_bs)


def make_exchange(implementation: str, group: ExpertCollectives, num_experts: int) -> FusedExchange | None:
    """The fused exchange named by kernels/ep_dispatch.py; None for the all-to-all reference."""
    return None if implementation == EP_REFERENCE else FusedExchange(implementation, group, num_experts)


class ExpertParallelDispatch:
    """A ``fused_moe`` with the reference signature that runs the experts over the EP group: through
    ``exchange`` when given (a fused vendor dispatch / combine), else three ``all_to_all``."""

    def __init__(self, fused_moe: Callable, placement: ExpertPlacement, group: ExpertCollectives,
                 exchange: FusedExchange | None = None) -> None:
        self.fused_moe, self.group, self.exchange = fused_moe, group, exchange
        self.physical = placement.physical_index()  # [E] logical -> rank * L + slot
        self.per_rank = placement.per_rank

    def with_fused_moe(self, fused_moe: Callable) -> "ExpertParallelDispatch":
        """The same placement and exchange running the local experts with ``fused_moe`` (quantized
        experts' kernel, engines/quantization/experts.py)."""
        dispatch = copy.copy(self)
        dispatch.fused_moe = fused_moe
        return dispatch

    def __call__(self, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
        """hidden [T, Hd] (the same on every rank); w13 / w2: this rank's L experts; topk_* [T, K]."""
        ep, rank = self.group.world_size, self.group.rank
        num_tokens = topk_ids.shape[0]
        chunk = -(-num_tokens // ep)
        lo, hi = min(rank * chunk, num_tokens), min((rank + 1) * chunk, num_tokens)
        if self.physical.device != topk_ids.device:
            self.physical = self.physical.to(topk_ids.device)
        physical = self.physical[topk_ids[lo:hi]]  # [t, K]

        def run_experts(rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
            return self._run_experts(rows, w13, w2, slots)

        if self.exchange is None:
            mine = self._all_to_all(hidden[lo:hi], physical, topk_weights[lo:hi], run_experts)
        else:  # every rank's chunk is at most ``chunk`` tokens
            mine = self.exchange(hidden[lo:hi], physical, topk_weights[lo:hi], run_experts, global_bs=chunk * ep)
        padded = mine.new_zeros(chunk, hidden.shape[1])
        padded[: hi - lo] = mine
        return torch.cat(self.group.all_gather(padded))[:num_tokens]

    def _all_to_all(self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                    run_experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """hidden [t, Hd] this rank's chunk; expert_ids [t, K] physical; weights [t, K] -> [t, Hd]."""
        ep, per_rank = self.group.world_size, self.per_rank
        tokens, k = expert_ids.shape
        physical = expert_ids.reshape(-1)  # [t * K]
        order = physical.argsort(stable=True)  # pairs grouped by destination rank, then slot
        rows = hidden.index_select(0, order // k)  # [t * K, Hd]
        # Row counts per (destination rank, slot) out; per (source rank, slot) in.
        send = torch.bincount(physical, minlength=ep * per_rank)
        recv = torch.empty_like(send)
        self.group.all_to_all(recv, send, [per_rank] * ep, [per_rank] * ep)
        send_splits = send.view(ep, per_rank).sum(1).tolist()
        recv_counts = recv.tolist()
        recv_splits = [sum(recv_counts[s * per_rank : (s + 1) * per_rank]) for s in range(ep)]
        received = rows.new_empty(sum(recv_splits), rows.shape[1])
        self.group.all_to_all(received, rows, recv_splits, send_splits)
        slots = torch.arange(per_rank, device=hidden.device).repeat(ep).repeat_interleave(
            recv.to(hidden.device))  # [n] the local slot of each received row
        out = run_experts(received, slots)  # [n, Hd]
        back = rows.new_empty(rows.shape)
        self.group.all_to_all(back, out, send_splits, recv_splits)
        # Back in (token, k) order, weighted and summed per token in float32 as the reference does.
        pairs = torch.empty_like(back).index_copy_(0, order, back).view(tokens, k, hidden.shape[1])
        return (pairs.float() * weights[:, :, None]).sum(1).to(hidden.dtype)  # [t, Hd]

    def _run_experts(self, rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     slots: torch.Tensor) -> torch.Tensor:
        if not len(rows):
            return rows
        ones = torch.ones(len(rows), 1, dtype=torch.float32, device=rows.device)
        return self.fused_moe(rows, w13, w2, ones, slots[:, None])


def check_expert_parallel(num_experts: int, ranks: int, model: str) -> None:
    """Raise ValueError naming ``model`` when its routed experts do not divide over ``ranks``."""
    if num_experts % ranks:
        raise ValueError(f"model {model}: enable_expert_parallel over {ranks} ranks does not fit: "
                         f"{num_experts} routed experts do not divide by {ranks}")


def place_experts(model: nn.Module, group: ExpertCollectives, name: str, placement: ExpertPlacement | None = None,
                  exchange: FusedExchange | None = None) -> ExpertPlacement | None:
    """Replace every MoE layer's routed experts with this rank's whole experts and its ``fused_moe``
    with the expert-parallel dispatch (through ``exchange``, else all-to-all), in place on the meta
    device. Returns the placement (None: the model has no MoE layer)."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    if not blocks:
        return None
    num_experts, hidden, intermediate = blocks[0].experts.down_proj.shape
    check_expert_parallel(num_experts, group.world_size, name)
    placement = placement or ExpertPlacement.contiguous(num_experts, group.world_size)
    for block in blocks:
        block.experts = ExpertParallelExperts(placement, group.rank, hidden, intermediate)
        block.fused_moe = ExpertParallelDispatch(block.fused_moe, placement, group, exchange)
    return placement
