"""Expert parallel's token exchange through Ascend's fused ``npu_moe_distribute_dispatch`` / ``_combine``
(MC2: the all-to-all and the weighted sum in two operators instead of three ``all_to_all_single``).

The engine (engines/models/expert_parallel.py) passes its communicator name, world size and rank: this
module imports nothing from engines/. Arguments follow the torch_npu documentation (no tensor-parallel
domain, no shared-expert ranks, no quantisation); ``unsupported`` holds the documented limits so the
choice falls back to the all-to-all reference before an operator would refuse. Tested against the fake
in tests/fakes/torch_npu only, never on a card. Importing this module raises ImportError where
torch_npu is not installed.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch_npu

# Documented EP world sizes: Atlas A2 16 / 32 / 64, Atlas A3 8 to 288 (these values)
EP_WORLD_SIZES = (8, 16, 32, 64, 128, 144, 256, 288)
MAX_TOKENS_PER_RANK = 256  # BS: 256 on A2, 512 on A3
MAX_TOP_K = 8  # 16 on A2, 8 on A3
MAX_EXPERTS = 512
MAX_HIDDEN = 7168


def unsupported(world_size: int, num_experts: int, top_k: int, hidden_size: int, dtype: torch.dtype,
                max_tokens_per_rank: int) -> str | None:
    """Why the fused operators cannot run this exchange (None: they can)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return f"{str(dtype).removeprefix('torch.')} unsupported (float16 / bfloat16 only)"
    if world_size not in EP_WORLD_SIZES:
        return f"ep_world_size {world_size} unsupported (one of {', '.join(map(str, EP_WORLD_SIZES))})"
    if not 0 < top_k <= MAX_TOP_K or num_experts > MAX_EXPERTS:
        return f"top_k {top_k} / {num_experts} experts unsupported (K <= {MAX_TOP_K}, experts <= {MAX_EXPERTS})"
    if hidden_size % 32 or hidden_size > MAX_HIDDEN:
        return f"hidden size {hidden_size} unsupported (a multiple of 32, <= {MAX_HIDDEN})"
    if max_tokens_per_rank > MAX_TOKENS_PER_RANK:
        return f"{max_tokens_per_rank} tokens per rank unsupported (<= {MAX_TOKENS_PER_RANK})"
    return None


def hccl_comm_name(group: dist.ProcessGroup, rank: int) -> str:
    """The HCCL communicator name of ``group`` that the operators take as ``group_ep``."""
    return group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)


def dispatch_combine(hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                     run_experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], group_name: str,
                     world_size: int, rank: int, num_experts: int, global_bs: int) -> torch.Tensor:
    """hidden [t, Hd] this rank's tokens (t may be 0); expert_ids [t, K] physical experts (rank * L +
    slot); weights [t, K]. ``run_experts(rows [n, Hd], slots [n])`` runs this rank's L experts on the
    rows received. ``global_bs`` >= the largest t over the ranks times ``world_size``, the same on every
    rank. Returns [t, Hd]: sum over k of weights * expert output."""
    tokens, k = expert_ids.shape
    if not tokens:  # the operators need BS > 0: one zero-weighted token, dropped afterwards
        hidden = hidden.new_zeros(1, hidden.shape[1])
        expert_ids = torch.arange(k, device=hidden.device)[None]
        weights = torch.zeros(1, k, device=hidden.device)
    ids = expert_ids.to(torch.int32)
    common = {"group_ep": group_name, "ep_world_size": world_size, "ep_rank_id": rank,
              "moe_expert_num": num_experts, "global_bs": global_bs}
    # expand_x [A, Hd]: the rows received, grouped by local expert; counts [L] rows per local expert
    expand_x, _, expand_idx, counts, ep_recv_counts, _, _ = torch_npu.npu_moe_distribute_dispatch(
        x=hidden, expert_ids=ids, expert_token_nums_type=1, **common)
    received = int(counts.sum())
    slots = torch.arange(len(counts), device=hidden.device).repeat_interleave(counts)  # [n]
    out = torch.zeros_like(expand_x)
    if received:
        out[:received] = run_experts(expand_x[:received], slots)
    combined = torch_npu.npu_moe_distribute_combine(
        expand_x=out, expert_ids=ids, expand_idx=expand_idx, ep_send_counts=ep_recv_counts,
        expert_scales=weights.float(), **common)
    return combined[:tokens]
