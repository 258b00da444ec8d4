"""``xinserve serve --node-rank K`` with K > 0: a machine that runs only its ranks of the
tensor-parallel groups, no HTTP server.

Every node runs the same config. Group number i (over every model's groups, in config order) has
its rendezvous at ``master_addr:master_port + i`` on node 0, whose worker process is the group's
rank 0; this node runs ranks ``[K * tp / nnodes, (K + 1) * tp / nnodes)`` of it. A rank exits when
its group breaks (rank 0 restarted, or another rank died); it is started again after a second, and
waits for the group's next rendezvous. SIGINT or SIGTERM stops them all.
"""

import logging
import signal
import subprocess
import time

from xinserve.engines.config import EngineConfig
from xinserve.engines.platforms import splits_host_threads
from xinserve.server.config import AppConfig
from xinserve.server.embedded_model.resolve import resolve_model_path
from xinserve.server.pool.model_pool import default_cpu_threads, group_engine_kwargs, local_cpu_ranks

logger = logging.getLogger("xinserve.node")

RESTART_DELAY_S = 1.0


def node_ranks(config: AppConfig) -> list[tuple[EngineConfig, int]]:
    """(the engine config of the rank's group, its rank) for every rank this node runs."""
    dist = config.distributed
    cpu_ranks = sum(local_cpu_ranks(g, dist) for m in config.models for g in m.groups if len(g) > 1)
    threads = default_cpu_threads(cpu_ranks)
    ranks, index = [], 0
    for model in config.models:
        path = resolve_model_path(model)
        for group in model.groups:
            if len(group) > 1:
                # a model's cpu_threads wins, as on node 0 (server/pool/model_pool.py)
                kwargs = group_engine_kwargs(group, dist, index, (model.cpu_threads or threads) if splits_host_threads(group[0]) else None,
                                             model.pipeline_parallel_size)
                engine = EngineConfig(model=path, device=group[0], **model.engine_kwargs(), **kwargs)
                ranks.extend((engine, rank) for rank in kwargs["parallel"].node_ranks(dist.node_rank))
            index += 1
    return ranks


def run_node(config: AppConfig, log_level: int) -> int:
    from xinserve.engines.parallel.tp_runner import spawn_rank

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ranks = node_ranks(config)
    if not ranks:
        logger.error("node %d runs no rank: no tensor-parallel group spans %d nodes",
                     config.distributed.node_rank, config.distributed.nnodes)
        return 2
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)

    def start(engine: EngineConfig, rank: int) -> subprocess.Popen:
        logger.info("starting rank %d of %s (rendezvous %s:%d)", rank, engine.model,
                    engine.parallel.master_addr, engine.parallel.master_port)
        return spawn_rank(engine, rank, engine.parallel.master_port, engine.parallel.cpu_threads)

    procs = [start(engine, rank) for engine, rank in ranks]
    while not stopping:
        time.sleep(0.2)
        for i, ((engine, rank), proc) in enumerate(zip(ranks, procs)):
            if proc.poll() is not None and not stopping:
                logger.warning("rank %d of %s exited with code %s; starting it again in %gs",
                               rank, engine.model, proc.returncode, RESTART_DELAY_S)
                time.sleep(RESTART_DELAY_S)
                procs[i] = start(engine, rank)
    for proc in procs:
        proc.kill()
        proc.wait()
    logger.info("node %d stopped", config.distributed.node_rank)
    return 0
