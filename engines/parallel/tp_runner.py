"""Rank 0 of a tensor-parallel replica: starts the other ranks of its node, forms the group, and
runs the ``ModelRunner`` with one broadcast of the step's inputs (engines/parallel/rank_messages.py) before
every forward (its ``broadcast`` hook). The other ranks (engines/parallel/tp_follower.py) rebuild the same
``StepBatch`` and run the same ``forward``; rank 0 alone samples. Commands (KV allocation, the KV pool's sizing, stop) travel
as messages of the same broadcast, so the ranks stay in lock-step.
"""

import base64
import logging
import os
import pickle
import subprocess
import sys
import weakref
from dataclasses import replace

import torch
import torch.distributed as dist

from xinserve.engines.config import EngineConfig
from xinserve.engines.core.sequence import needs_prompt_logits
from xinserve.engines.models.tensor_parallel import check_model_splits
from xinserve.engines.parallel.distributed import GroupFailure, ParallelGroup, open_store
from xinserve.engines.parallel.parallel_config import ParallelConfig
from xinserve.engines.parallel.pipeline_parallel import check_pipeline, rank_role, stage_collectives
from xinserve.engines.parallel.rank_messages import (
    Allocate,
    CatchUp,
    Chain,
    LoraDrop,
    LoraLoad,
    Profile,
    RankMessage,
    Step,
    Stop,
    pack,
)
from xinserve.engines.platforms import Platform, ranks_share_the_device
from xinserve.engines.speculative.mtp_runner import MTPModelRunner
from xinserve.engines.worker.runner import ModelRunner, StepBatch

logger = logging.getLogger(__name__)

STOP_WAIT_S = 10.0


def parallel_config(config: EngineConfig) -> ParallelConfig:
    """The group's layout: the config's, or ``tensor_parallel_size`` ranks on one node: all on the
    CPU for ``device`` cpu, else consecutive cards from ``device``'s (``npu:2`` -> npu:2, npu:3, ...)."""
    ranks = config.tensor_parallel_size * config.pipeline_parallel_size
    parallel = config.parallel or ParallelConfig(devices=default_devices(config.device, ranks))
    if parallel.world_size != ranks:
        raise ValueError(f"model {config.model}: tensor_parallel_size {config.tensor_parallel_size} x "
                         f"pipeline_parallel_size {config.pipeline_parallel_size} but {parallel.world_size} "
                         f"devices ({', '.join(parallel.devices)})")
    parallel.check(config.model)
    return parallel


def default_devices(device: str, tp: int) -> list[str]:
    if ranks_share_the_device(device):
        return [device] * tp
    kind, _, index = device.partition(":")
    first = int(index or 0)
    return [f"{kind}:{first + rank}" for rank in range(tp)]


def cpu_threads_per_rank(parallel: ParallelConfig, node: int) -> int:
    """A CPU rank's torch threads: the configured count, else this process's shared by the node's ranks."""
    local = len(parallel.node_ranks(node))
    return parallel.cpu_threads or max(1, torch.get_num_threads() // local)


def spawn_rank(config: EngineConfig, rank: int, master_port: int, threads: int | None) -> subprocess.Popen:
    """Start rank ``rank`` (> 0) of the group in its own process (``python -m xinserve.engines.parallel.tp_follower``).

    A plain subprocess, not multiprocessing: a server worker is a daemon process, which may not
    have multiprocessing children. The child watches this process and leaves when it dies
    (engines/parallel/tp_follower.py), whichever thread started it.
    """
    payload = base64.b64encode(pickle.dumps((config, rank, master_port, threads, os.getpid()))).decode()
    return subprocess.Popen([sys.executable, "-m", "xinserve.engines.parallel.tp_follower", payload])


def make_runner(config: EngineConfig, platform: Platform, block_size: int, eos_token_ids: list[int]) -> ModelRunner:
    """The runner of an engine: plain on one device, else rank 0 of a tensor-parallel group."""
    if config.tensor_parallel_size * config.pipeline_parallel_size == 1:
        runner = MTPModelRunner if config.uses_mtp else ModelRunner
        return runner(config, platform, block_size, eos_token_ids)
    parallel = parallel_config(config)
    if config.tensor_parallel_size > 1:
        check_model_splits(config.model, config.tensor_parallel_size, config.enable_expert_parallel)
    check_pipeline(config.model, config.pipeline_parallel_size)
    if dist.is_initialized():
        # torch.distributed has one default group per process: the engine that holds it must go first.
        raise RuntimeError(f"model {config.model}: this process already holds a tensor-parallel group (another "
                           "engine is still open); close() it, or drop every reference to it, first")
    store = open_store(0, parallel.world_size, parallel.master_addr, parallel.master_port,
                       parallel.rendezvous_timeout_s)
    previous_threads = torch.get_num_threads()
    threads = cpu_threads_per_rank(parallel, 0) if platform.splits_host_threads else None
    # The followers read the config with the port fixed, so that all find the same store.
    config = replace(config, parallel=replace(parallel, master_port=store.port))
    followers = {rank: spawn_rank(config, rank, store.port, threads) for rank in parallel.node_ranks(0)[1:]}
    group = None
    try:
        if threads:
            torch.set_num_threads(threads)
        group = ParallelGroup(0, parallel.world_size, platform.dist_backend, platform.device, store,
                              parallel.rendezvous_timeout_s, parallel.step_timeout_s)
        runner = TensorParallelMTPRunner if config.uses_mtp else TensorParallelRunner
        return runner(config, platform, block_size, eos_token_ids, group, parallel, followers, previous_threads)
    except BaseException:
        _stop(followers, 0)
        if group is not None:
            group.close()
        torch.set_num_threads(previous_threads)
        raise


class TensorParallelRunner(ModelRunner):
    def __init__(
        self,
        config: EngineConfig,
        platform: Platform,
        block_size: int,
        eos_token_ids: list[int],
        group: ParallelGroup,
        parallel: ParallelConfig,
        followers: dict[int, subprocess.Popen],
        previous_threads: int,
    ) -> None:
        self.group, self.parallel, self.followers = group, parallel, followers
        self.tp, self.expert_parallel = config.tensor_parallel_size, config.enable_expert_parallel
        layers_group, stage = stage_collectives(group, self.tp, config.pipeline_parallel_size)
        super().__init__(config, platform, block_size, eos_token_ids, group=layers_group,
                         pipeline=stage)  # a failure: make_runner's
        # Releases the group when close() is called, when the runner is garbage-collected, or at exit
        # (an engine never closed). It holds the group and the processes, never the runner itself.
        self._release = weakref.finalize(self, _release_group, group, followers, previous_threads)

    def ranks(self) -> list[dict]:
        """Each rank's device, node, (on this node) pid and role, for /health."""
        local = {0: os.getpid(), **{rank: proc.pid for rank, proc in self.followers.items()}}
        per_node = self.parallel.world_size // self.parallel.nnodes
        return [{"rank": rank, "device": device, "pid": local.get(rank), "node": rank // per_node,
                 "role": rank_role(rank, self.tp, self.parallel.world_size // self.tp, self.model,
                                   self.expert_parallel).as_dict()}
                for rank, device in enumerate(self.parallel.devices)]

    def broadcast(self, batch: StepBatch) -> None:
        self._send(Step(batch, prompt_logit_rows(batch) if batch.needs_prompt_logits else None))

    def load_lora(self, adapter_id: int, path: str) -> None:
        """Rank 0 reads (and checks) it first; then every other rank reads its own shard's copy."""
        super().load_lora(adapter_id, path)
        self._send(LoraLoad(adapter_id, path))

    def drop_lora(self, adapter_id: int) -> None:
        super().drop_lora(adapter_id)
        self._send(LoraDrop(adapter_id))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._send(Allocate(num_blocks))
        super().allocate_kv_cache(num_blocks)

    def profile_num_blocks(
        self, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, fraction: float
    ) -> int:
        """Every rank sizes its pool from its own free memory; the group uses the smallest."""
        num_blocks = super().profile_num_blocks(max_num_batched_tokens, max_num_seqs, max_model_len, fraction)
        self._send(Profile(fraction))
        return self.group.min_over_ranks(num_blocks)

    def _send(self, message: RankMessage) -> None:
        for rank, proc in self.followers.items():
            if proc.poll() is not None:
                raise GroupFailure(f"rank {rank} (pid {proc.pid}) of the tensor-parallel group exited "
                                   f"with code {proc.returncode}")
        self.group.broadcast_message(pack(message))

    def close(self) -> None:
        """Stop the other ranks (a STOP message, then a kill after a grace) and leave the group."""
        self._release()


class TensorParallelMTPRunner(TensorParallelRunner, MTPModelRunner):
    """Rank 0 with speculative method ``mtp``: its MTP work is shared before it runs (engines/speculative/)."""

    def share(self, work: Chain | CatchUp) -> None:
        self._send(work)


def prompt_logit_rows(batch: StepBatch) -> list[tuple[int, int]]:
    """The (first row, count) of each ``compute_logits`` call that ``ModelRunner._with_prompt_logprobs``
    makes for prompt log-probs, in its order: the followers make the same calls (the logits gather
    is a collective)."""
    rows = []
    for seq, start, first_row, count in batch.spans():
        if needs_prompt_logits(seq):
            targets = min(start + 1 + count, seq.num_prompt_tokens) - (start + 1)
            if targets > 0:
                rows.append((first_row, targets))
    return rows


def _release_group(group: ParallelGroup, followers: dict[int, subprocess.Popen], previous_threads: int) -> None:
    """Stop the other ranks, destroy the process group and free the rendezvous port, so that a new
    tensor-parallel engine can start in this process."""
    try:
        if all(proc.poll() is None for proc in followers.values()):
            group.broadcast_message(pack(Stop()))
    except GroupFailure:
        logger.warning("a rank was already gone when the group stopped")
    _stop(followers, STOP_WAIT_S)
    group.close()
    torch.set_num_threads(previous_threads)


def _stop(followers: dict[int, subprocess.Popen], wait_s: float) -> None:
    for proc in followers.values():
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
