"""FAKE fused expert-parallel exchange (``npu_moe_distribute_dispatch`` / ``_combine``), for tests only,
over torch.distributed (gloo on CPU), plus the HCCL communicator-name lookup the real path uses.

Modelled from the torch_npu / CANN operator documentation: no tensor-parallel domain (``group_tp`` "",
``tp_world_size`` 0), no shared-expert ranks, no quantisation (``quant_mode`` 0). Dispatch sends each
(token, k) row of ``x`` to the rank holding expert ``expert_ids[t, k]`` (rank = id // L, L = experts per
rank) and returns what this rank received as ``expand_x`` [A, H], grouped by local expert, then by
source rank, then in the source's row order; ``expert_token_nums`` [L] counts the rows per local expert
(``expert_token_nums_type`` 1) or their running sum (0); ``ep_recv_counts`` [ws * L] int32 is the
running sum of the rows per (local expert, source rank), expert-major (the Atlas A3 layout).
``expand_idx`` [BS * K] int32 is opaque to callers (they pass it on to combine): here, each row's place
among the rows this rank sent to the same rank. Combine sends the expert outputs back along the same
path and returns x [BS, H] = sum over k of expert_scales[t, k] * out[t, k], in float32, cast to
``expand_x``'s dtype.

Checked as the real operators check: half-precision x, int32 expert ids [BS, K] with K distinct ids
per row in [0, moe_expert_num), 0 < BS, K <= 16, moe_expert_num <= 512 and divisible by the ranks,
H a multiple of 32 up to 7168, A >= BS * ws * min(L, K) (or global_bs * min(L, K)), a group name of
1-127 characters that names a group whose rank is ``ep_rank_id``, float32 expert_scales [BS, K].
Not modelled: the chip-specific EP world sizes (16/32/64 on A2, 8-288 on A3; kernels/ascend/moe_dispatch.py
refuses others before calling), HCCL_BUFFSIZE, and that the EP group must carry no other collective.
"""

import torch
import torch.distributed as dist

HALF = (torch.float16, torch.bfloat16)
_groups: dict[str, dist.ProcessGroup] = {}  # communicator name -> group


def _check(ok: bool, op: str, detail: str) -> None:
    if not ok:
        raise RuntimeError(f"call {op} failed, error code 161002: {detail}")


class _HcclBackend:
    """What ``ProcessGroup._get_backend(torch.device("npu"))`` returns with the real torch_npu."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def get_hccl_comm_name(self, rank: int) -> str:
        for name, group in _groups.items():
            if group is self.group:
                return name
        name = f"fake_hccl_comm_{len(_groups)}"
        _groups[name] = self.group
        return name


_cpu_get_backend = dist.ProcessGroup._get_backend


def _get_backend(self: dist.ProcessGroup, device: torch.device) -> object:
    if torch.device(device).type == "npu":
        return _HcclBackend(self)
    return _cpu_get_backend(self, device)


dist.ProcessGroup._get_backend = _get_backend  # the real torch_npu registers its HCCL backend for "npu"


def _group(op: str, group_ep: str, ep_world_size: int, ep_rank_id: int) -> dist.ProcessGroup:
    _check(isinstance(group_ep, str) and 1 <= len(group_ep) < 128, op, "group_ep must be 1-127 characters")
    _check(group_ep in _groups, op, f"group_ep {group_ep!r} names no HCCL communicator")
    group = _groups[group_ep]
    _check(dist.get_world_size(group) == ep_world_size, op, f"ep_world_size {ep_world_size} is not the group's")
    _check(dist.get_rank(group) == ep_rank_id, op, f"ep_rank_id {ep_rank_id} is not this rank in the group")
    return group


def _check_routing(op: str, x_rows: int, expert_ids: torch.Tensor, ep_world_size: int, moe_expert_num: int) -> int:
    """Checks shared by both operators; returns L, the experts per rank."""
    _check(expert_ids.dim() == 2 and expert_ids.dtype == torch.int32 and expert_ids.shape[0] == x_rows, op,
           f"expert_ids must be [BS, K] int32, got {expert_ids.dtype}{tuple(expert_ids.shape)}")
    k = expert_ids.shape[1]
    _check(x_rows > 0 and 0 < k <= min(16, moe_expert_num), op, f"BS {x_rows} and K {k} out of range")
    _check(0 < moe_expert_num <= 512 and moe_expert_num % ep_world_size == 0, op,
           f"moe_expert_num {moe_expert_num} must be in [1, 512] and divide by ep_world_size {ep_world_size}")
    _check(bool(((expert_ids >= 0) & (expert_ids < moe_expert_num)).all()), op, "expert id out of range")
    _check(bool((expert_ids.sort(1).values.diff(dim=1) != 0).all()), op, "a row repeats an expert")
    return moe_expert_num // ep_world_size


def _max_received(op: str, group: dist.ProcessGroup, bs: int, ep_world_size: int, per_rank: int, k: int,
                  global_bs: int) -> int:
    """A, the rows this rank may receive; every rank's BS must fit global_bs (or be equal when it is 0)."""
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(ep_world_size)]
    dist.all_gather(sizes, torch.tensor([bs]), group=group)
    largest = max(int(s) for s in sizes)
    if global_bs == 0:
        _check(all(int(s) == bs for s in sizes), op, "ranks send different BS: global_bs must be given")
        return bs * ep_world_size * min(per_rank, k)
    _check(global_bs >= largest * ep_world_size, op, f"global_bs {global_bs} < max BS {largest} * ep_world_size")
    return global_bs * min(per_rank, k)


def npu_moe_distribute_dispatch(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *,
                                scales=None, x_active_mask=None, expert_scales=None, group_tp="", tp_world_size=0,
                                tp_rank_id=0, expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0,
                                quant_mode=0, global_bs=0, expert_token_nums_type=1):
    """Returns (expand_x, dynamic_scales, expand_idx, expert_token_nums, ep_recv_counts, tp_recv_counts,
    expand_scales); dynamic_scales, tp_recv_counts and expand_scales are None here (no quantisation,
    no TP domain, no expert_scales)."""
    op = "aclnnMoeDistributeDispatch"
    if quant_mode or scales is not None or group_tp or tp_world_size > 1 or shared_expert_rank_num \
            or expert_scales is not None:
        raise NotImplementedError("the fake models no quantisation, no TP domain, no shared-expert ranks")
    group = _group(op, group_ep, ep_world_size, ep_rank_id)
    _check(x.dim() == 2 and x.dtype in HALF, op, f"x must be 2-D float16 / bfloat16, got {x.dtype}")
    _check(0 < x.shape[1] <= 7168 and x.shape[1] % 32 == 0, op, f"H {x.shape[1]} must be a multiple of 32, <= 7168")
    per_rank = _check_routing(op, x.shape[0], expert_ids, ep_world_size, moe_expert_num)
    _check(expert_token_nums_type in (0, 1), op, f"expert_token_nums_type {expert_token_nums_type}")
    bs, k = expert_ids.shape
    capacity = _max_received(op, group, bs, ep_world_size, per_rank, k, global_bs)
    flat = expert_ids.reshape(-1).long()  # [BS * K]
    order = flat.argsort(stable=True)  # rows by destination rank, then local expert
    send = torch.bincount(flat, minlength=moe_expert_num)  # rows per (destination, local expert)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # now: rows per (source, my local expert)
    rows_in = recv.view(ep_world_size, per_rank)
    received = x.new_empty(int(recv.sum()), x.shape[1])
    dist.all_to_all_single(received, x.index_select(0, order // k).contiguous(), recv.view(ep_world_size, -1)
                           .sum(1).tolist(), send.view(ep_world_size, -1).sum(1).tolist(), group=group)
    # Source-major as received -> expert-major, each expert's rows by source rank.
    source_major = torch.arange(ep_world_size).repeat_interleave(per_rank)  # [ws * L] source of each block
    expert_of_block = torch.arange(per_rank).repeat(ep_world_size)
    block_of_row = torch.arange(ep_world_size * per_rank).repeat_interleave(recv)
    expert_major = (expert_of_block * ep_world_size + source_major)[block_of_row].argsort(stable=True)
    _check(len(received) <= capacity, op, f"{len(received)} rows received exceed A = {capacity}")
    expand_x = x.new_zeros(capacity, x.shape[1])
    expand_x[: len(received)] = received[expert_major]
    expert_token_nums = rows_in.sum(0)
    if expert_token_nums_type == 0:
        expert_token_nums = expert_token_nums.cumsum(0)
    ep_recv_counts = rows_in.t().reshape(-1).cumsum(0).to(torch.int32)  # [L * ws] expert-major running sum
    dest = flat // per_rank
    place = torch.empty_like(flat)
    starts = torch.bincount(dest, minlength=ep_world_size).cumsum(0) - torch.bincount(dest, minlength=ep_world_size)
    place[order] = torch.arange(len(flat)) - starts[dest[order]]
    return expand_x, None, place.to(torch.int32), expert_token_nums, ep_recv_counts, None, None


def npu_moe_distribute_combine(expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales, group_ep,
                               ep_world_size, ep_rank_id, moe_expert_num, *, tp_send_counts=None,
                               x_active_mask=None, activation_scale=None, weight_scale=None, group_list=None,
                               expand_scales=None, shared_expert_x=None, group_tp="", tp_world_size=0, tp_rank_id=0,
                               expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0, global_bs=0,
                               out_dtype=0, comm_quant_mode=0, group_list_type=0):
    """x [BS, H]: each token's expert outputs, sent back along the dispatch's path, weighted and summed."""
    op = "aclnnMoeDistributeCombine"
    if group_tp or tp_world_size > 1 or shared_expert_rank_num or comm_quant_mode or tp_send_counts is not None:
        raise NotImplementedError("the fake models no TP domain, no shared-expert ranks, no quantisation")
    group = _group(op, group_ep, ep_world_size, ep_rank_id)
    _check(expand_x.dim() == 2 and expand_x.dtype in HALF, op, "expand_x must be 2-D float16 / bfloat16")
    per_rank = _check_routing(op, expert_scales.shape[0], expert_ids, ep_world_size, moe_expert_num)
    bs, k = expert_ids.shape
    _check(expert_scales.dtype == torch.float32 and expert_scales.shape == (bs, k), op,
           f"expert_scales must be [{bs}, {k}] float32")
    _check(expand_idx.dtype == torch.int32 and expand_idx.shape == (bs * k,), op, f"expand_idx must be [{bs * k}] int32")
    _check(ep_send_counts.dtype == torch.int32 and ep_send_counts.shape == (ep_world_size * per_rank,), op,
           f"ep_send_counts must be [{ep_world_size * per_rank}] int32")
    counts = ep_send_counts.long().diff(prepend=ep_send_counts.new_zeros(1).long())  # [L * ws] expert-major
    _check(int(ep_send_counts[-1]) <= expand_x.shape[0], op, "ep_send_counts exceed expand_x")
    # Expert-major -> source-major: what goes back to each rank, in the order it was sent.
    source_of_block = torch.arange(ep_world_size).repeat(per_rank)
    expert_of_block = torch.arange(per_rank).repeat_interleave(ep_world_size)
    block_of_row = torch.arange(ep_world_size * per_rank).repeat_interleave(counts)
    source_major = (source_of_block * per_rank + expert_of_block)[block_of_row].argsort(stable=True)
    back_splits = counts.view(per_rank, ep_world_size).sum(0).tolist()
    dest = expert_ids.reshape(-1).long() // per_rank
    sent = torch.bincount(dest, minlength=ep_world_size)
    returned = expand_x.new_empty(bs * k, expand_x.shape[1])
    dist.all_to_all_single(returned, expand_x[: len(source_major)][source_major].contiguous(), sent.tolist(),
                           back_splits, group=group)
    rows = returned[(sent.cumsum(0) - sent)[dest] + expand_idx.long()].view(bs, k, -1)  # [BS, K, H]
    return (rows.float() * expert_scales[:, :, None]).sum(1).to(expand_x.dtype)
