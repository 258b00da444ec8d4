"""``xinserve warmup``: fill the caches a server's CPU workers start from, without serving.

Takes what ``serve`` takes (``--config FILE``, or ``--model PATH`` with engine flags; nothing: the
embedded default) and, for every CPU worker of every model, builds the engine as that worker would
(the same settings and torch threads), which builds the C++ kernels, times the kernel and thread
choices, and compiles each decode bucket in a child process into ``$XINSERVE_CACHE_DIR``
(engines/compile/). A server started on those caches loads every bucket before it reports ready.
Run it in a Docker build step, a Kubernetes init container, or once on a volume the replicas share
(docs/operations.md). A bucket that failed to compile is reported (it runs eagerly, slower but correct)
and does not fail the command: an init container that exits non-zero keeps its pod from starting.
"""

import logging
from collections.abc import Iterator
from dataclasses import replace

from xinserve.engines.config import EngineConfig
from xinserve.engines.platforms import splits_host_threads
from xinserve.server.config import AppConfig
from xinserve.server.embedded_model.resolve import resolve_model_path
from xinserve.server.pool.model_pool import cpu_thread_share, default_cpu_threads, local_cpu_ranks


def cpu_worker_engines(config: AppConfig) -> Iterator[tuple[str, EngineConfig, int]]:
    """(model name, engine config, torch threads) of each single-device CPU worker, as the server sets
    them (server/app.py, server/pool/model_pool.py); tensor-parallel groups compile nothing."""
    num_cpu_workers = sum(local_cpu_ranks(g, config.distributed) for m in config.models for g in m.groups)
    threads, share = default_cpu_threads(num_cpu_workers), cpu_thread_share(num_cpu_workers)
    for model in config.models:
        cpu_groups = [g for g in model.groups if len(g) == 1 and splits_host_threads(g[0])]
        if not cpu_groups:
            continue
        path = resolve_model_path(model)
        kwargs = model.engine_kwargs()
        if not model.cpu_threads and model.max_cpu_threads is None:
            kwargs["max_cpu_threads"] = share
        for device in sorted({g[0] for g in cpu_groups}):  # workers on one device compile the same buckets
            yield model.name, EngineConfig(model=path, device=device, **kwargs), model.cpu_threads or threads


def run(app_config: AppConfig, log_level: str) -> int:
    """Warm every CPU worker of ``app_config`` (``serve``'s config from the same flags: server/cli/main.py)."""
    import torch

    from xinserve.engines import LLMEngine

    logging.basicConfig(level=getattr(logging, log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    failed, warmed = 0, 0
    for name, config, threads in cpu_worker_engines(app_config):
        torch.set_num_threads(threads)
        engine = LLMEngine(replace(config, warm_up_in_background=False, ready_when_warm=False))
        try:
            report = engine.warmup.report()
        finally:
            engine.close()
        states = {size: bucket["state"] for size, bucket in report["buckets"].items()}
        failed += sum(state == "failed" for state in states.values())
        warmed += 1
        print(f"{name} on {config.device} ({threads} threads, compile {report['mode']}): "
              + (", ".join(f"bucket {size} {state}" for size, state in states.items()) or "nothing to compile"))
    if not warmed:
        print("no CPU worker in this config: nothing to warm (accelerators capture their graphs at start)")
    if failed:
        print(f"warning: {failed} decode bucket(s) failed to compile and will run eagerly (see the log above)")
    return 0
