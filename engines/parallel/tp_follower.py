"""A rank > 0 of a tensor-parallel replica: ``python -m xinserve.engines.parallel.tp_follower PAYLOAD``.

It joins the group, loads its shard of the model, then follows rank 0's messages: each STEP is
rebuilt into the ``StepBatch`` rank 0 built and run through the same ``ModelRunner.forward`` (or, in
a step with prompt log-probs, the same sequence of logits computations); rank 0 samples. It leaves
on STOP, or when the group breaks (rank 0 gone), or when its parent process dies.
"""

import base64
import logging
import os
import pickle
import select
import signal
import sys
import threading
import time

import torch

from xinserve.engines.config import EngineConfig
from xinserve.engines.parallel.distributed import GroupFailure, ParallelGroup, open_store
from xinserve.engines.parallel.pipeline_parallel import stage_collectives
from xinserve.engines.parallel.rank_messages import (
    Allocate,
    CatchUp,
    Chain,
    LoraDrop,
    LoraLoad,
    Profile,
    Step,
    Stop,
    unpack,
)
from xinserve.engines.parallel.tp_runner import parallel_config
from xinserve.engines.platforms import get_platform
from xinserve.engines.speculative.mtp_runner import MTPModelRunner
from xinserve.engines.worker.process_exit import leave_quickly
from xinserve.engines.worker.runner import ModelRunner, StepBatch

logger = logging.getLogger("xinserve.rank")

PARENT_POLL_S = 0.5  # where no pidfd exists: how often the parent is looked for


def run_rank(config: EngineConfig, rank: int, master_port: int, threads: int | None) -> None:
    parallel = parallel_config(config)
    platform = get_platform(parallel.devices[rank])
    if threads and platform.splits_host_threads:
        torch.set_num_threads(threads)
    store = open_store(rank, parallel.world_size, parallel.master_addr, master_port, parallel.rendezvous_timeout_s)
    group = ParallelGroup(rank, parallel.world_size, platform.dist_backend, platform.device, store,
                          parallel.rendezvous_timeout_s, parallel.step_timeout_s)
    try:
        block_size = config.block_size or platform.default_block_size
        layers_group, stage = stage_collectives(group, config.tensor_parallel_size, config.pipeline_parallel_size)
        runner_cls = MTPModelRunner if config.uses_mtp else ModelRunner
        runner = runner_cls(config, platform, block_size, [], group=layers_group, pipeline=stage)
        logger.info("rank %d of %d ready on %s", rank, parallel.world_size, platform.device)
        follow(runner, group)
    finally:
        group.close()


@torch.inference_mode()
def follow(runner: ModelRunner, group: ParallelGroup) -> None:
    """Serve rank 0's messages until STOP."""
    while True:
        try:
            message = unpack(group.broadcast_message(None), runner.device, runner.block_size)
        except ValueError as exc:
            raise GroupFailure(f"rank {group.rank}: {exc}") from None
        match message:
            case Step(batch, prompt_rows):
                if not runner.computes_logits:  # a later pipeline stage: its layers only
                    runner.model(batch.input_ids, batch.positions, runner.kv_cache, batch.metadata)
                elif prompt_rows is None:
                    runner.forward(batch)
                else:
                    _prompt_logprobs_step(runner, batch, prompt_rows)
            case Allocate(num_blocks):
                runner.allocate_kv_cache(num_blocks)
            case Profile(fraction):
                group.min_over_ranks(runner.blocks_that_fit(fraction))
            case LoraLoad(adapter_id, path):
                runner.load_lora(adapter_id, path)
            case LoraDrop(adapter_id):
                runner.drop_lora(adapter_id)
            case Stop():
                return
            case Chain() | CatchUp() if isinstance(runner, MTPModelRunner):
                runner.follow(message)
            case _:
                raise GroupFailure(f"rank {group.rank}: unexpected message {type(message).__name__}")


def _prompt_logprobs_step(runner: ModelRunner, batch: StepBatch, prompt_rows: list[tuple[int, int]]) -> None:
    """The collectives of ``ModelRunner._with_prompt_logprobs``: the forward, one logits gather per
    prompt row range, then the sampled rows' logits."""
    model = runner.model
    runner.apply_lora(batch)
    hidden = model(batch.input_ids, batch.positions, runner.kv_cache, batch.metadata)  # [T, hidden]
    for row, count in prompt_rows:
        model.compute_logits(hidden[row : row + count])
    if batch.sampled:
        if batch.logits_indices is not None:
            hidden = hidden.index_select(0, batch.logits_indices)
        model.compute_logits(hidden)


def watch_parent(parent_pid: int) -> None:
    """Exit this process at once when process ``parent_pid`` (rank 0's) ends, so no rank outlives its
    replica. A daemon thread waits on a pidfd of the parent (readable once the whole process has
    exited), else polls ``getppid``. Not PR_SET_PDEATHSIG: that fires when the *thread* that started
    this process exits, and a server or an offline user may start an engine from a passing thread."""
    try:
        pidfd = os.pidfd_open(parent_pid)
    except (AttributeError, OSError):  # not Linux >= 5.3, or the parent is already gone
        pidfd = None
    if os.getppid() != parent_pid:  # the parent died before we looked (the pidfd may name another process)
        os._exit(1)
    threading.Thread(target=_exit_when_gone, args=(parent_pid, pidfd), name="watch-parent", daemon=True).start()


def _exit_when_gone(parent_pid: int, pidfd: int | None) -> None:
    if pidfd is not None:
        select.select([pidfd], [], [])
    else:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
    logger.error("rank 0's process %d is gone; leaving", parent_pid)
    os._exit(1)


def main() -> None:
    config, rank, master_port, threads, parent_pid = pickle.loads(base64.b64decode(sys.argv[1]))
    watch_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; rank 0 stops the others
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [rank {rank}] %(message)s")
    try:
        run_rank(config, rank, master_port, threads)
    except GroupFailure as exc:
        logger.error("%s; leaving", exc)
        sys.exit(1)
    except Exception:
        logger.exception("rank %d failed", rank)
        sys.exit(1)
    leave_quickly()


if __name__ == "__main__":
    main()
