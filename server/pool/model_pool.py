"""One served model: its tokenizer (loaded in the HTTP process) and its worker processes."""

import asyncio
import dataclasses
import logging
import os
import time
from typing import Any

from xinserve.engines.parallel.parallel_config import ParallelConfig
from xinserve.engines.platforms import splits_host_threads
from xinserve.engines.worker.gc_pauses import freeze_heap
from xinserve.server.api.openai.view import TokenTexts
from xinserve.server.config import DistributedSettings, ModelSettings
from xinserve.server.embedded_model.hub import local_path
from xinserve.server.embedded_model.resolve import resolve_model_path
from xinserve.server.http.heavy_imports import IMPORT_LOCK
from xinserve.server.pool import heartbeat
from xinserve.server.pool.worker_client import FAILED, STARTING, WorkerClient
from xinserve.server.worker.engine_worker import WorkerSpec

logger = logging.getLogger("xinserve.server")


def worker_labels(devices: list[str]) -> list[str]:
    """Metric/health labels: the device, or ``device#k`` when a model lists a device twice."""
    return [d if devices.count(d) == 1 else f"{d}#{devices[:i].count(d)}" for i, d in enumerate(devices)]


def group_engine_kwargs(
    group: list[str], distributed: DistributedSettings, index: int, cpu_threads: int | None, pp: int = 1
) -> dict[str, Any]:
    """The engine options of tensor-parallel group number ``index`` (over every model's groups, in
    config order: its rendezvous port is ``master_port + index``); ``pp`` pipeline stages of
    ``len(group) / pp`` ranks each."""
    port = distributed.master_port + index if distributed.master_port else 0
    parallel = ParallelConfig(
        devices=list(group), nnodes=distributed.nnodes, master_addr=distributed.master_addr, master_port=port,
        rendezvous_timeout_s=distributed.rendezvous_timeout_s, cpu_threads=cpu_threads,
    )
    return {"tensor_parallel_size": len(group) // pp, "parallel": parallel}


def local_cpu_ranks(group: list[str], distributed: DistributedSettings) -> int:
    """CPU ranks of ``group`` on this node (the group's ranks split evenly over the nodes)."""
    if len(group) == 1:
        return int(splits_host_threads(group[0]) and distributed.node_rank == 0)
    per_node = len(group) // distributed.nnodes
    return sum(map(splits_host_threads, group[distributed.node_rank * per_node : (distributed.node_rank + 1) * per_node]))


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_cpu_threads(num_cpu_workers: int) -> int:
    """Cores left after one for the HTTP process, shared between CPU workers (at least one each).

    On two cores a single CPU worker gets one thread: the event loop detokenising and streaming
    on the other core measured faster than both fighting over two.
    """
    return max(1, (available_cores() - 1) // max(1, num_cpu_workers))


def cpu_thread_share(num_cpu_workers: int) -> int:
    """Every core, shared between CPU workers: the most threads a worker times its decode step with at
    start before keeping the faster of that and ``default_cpu_threads`` (engines/worker/thread_split.py)."""
    return max(1, available_cores() // max(1, num_cpu_workers))


def load_tokenizer(path: str) -> Any:
    """The tokenizer at ``path``, one load at a time (server/http/heavy_imports.py: the first imports
    transformers and torch, ~5 CPU seconds, beside the workers spawned before it).

    xgrammar too: the first request with a JSON schema checks it (server/api/openai/protocol.py) while its body is
    parsed, on the event loop, and importing xgrammar there held every stream for ~0.4 s once. Here the
    import overlaps the workers' start."""
    with IMPORT_LOCK:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        try:
            import xgrammar  # noqa: F401
        except ImportError as exc:  # the model still serves; only JSON-schema requests need it
            logger.warning("xgrammar does not import (%s): structured outputs will fail", exc)
    return tokenizer


# The CPU workers' OpenMP threads sleep at a barrier instead of spinning. libgomp reads this when torch
# loads in the spawned child, before any of its code runs, so it is set here, in the parent, unless the
# user set it. With the HTTP process busy on the other core, a spinning thread waits for a peer that was
# descheduled: under load, a batch-8 x 512 decode step on 2 threads took 386-886 ms spinning, 13-41 ms
# passive (1 thread: 30-80 ms); docs/performance.md (decode step vs its floor).
WORKER_OPENMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def set_worker_openmp_env() -> None:
    """Make the workers spawned from now on start with ``WORKER_OPENMP_ENV`` (a user's value wins)."""
    for name, value in WORKER_OPENMP_ENV.items():
        os.environ.setdefault(name, value)


class ModelPool:
    def __init__(
        self, settings: ModelSettings, cpu_threads: int, log_level: int,
        distributed: DistributedSettings | None = None, first_group: int = 0, heartbeat_timeout_s: float = 10.0,
        max_cpu_threads: int | None = None,
    ) -> None:
        self.settings = settings
        self.distributed = distributed or DistributedSettings()
        self.first_group = first_group  # this model's first group's index over every model's groups
        self.tokenizer: Any = None
        self.token_texts: TokenTexts | None = None
        self.error: str | None = None
        self._progress: asyncio.Task | None = None
        self.cpu_threads = cpu_threads
        self.max_cpu_threads = max_cpu_threads  # timed against cpu_threads at start unless the model fixes its own
        self.log_level = log_level
        self.heartbeat_timeout_s = heartbeat_timeout_s
        # One worker per replica, labelled by its device ("npu:0+npu:1" for a tensor-parallel group).
        groups = settings.groups
        self.groups = {}
        self.workers = []
        # LoRA adapters requests may name, name -> PEFT directory: lora_modules, then runtime loads.
        self.adapters: dict[str, str] = dict(settings.lora_modules or {})
        # Local directories of the weights and the tokenizer, once start() has resolved them.
        self.model_path: str | None = None
        self.tokenizer_path: str | None = None
        for label, group in zip(worker_labels(["+".join(g) for g in groups]), groups, strict=True):
            self.workers.append(WorkerClient(settings.name, label, group[0], settings.max_num_seqs,
                                             settings.max_waiting_requests, devices=group,
                                             heartbeat_timeout_s=heartbeat_timeout_s))
            self.groups[label] = group

    @property
    def name(self) -> str:
        return self.settings.name

    async def start(self, ipc_dir: str) -> None:
        """Build/locate the model, spawn the workers, load the tokenizer alongside them.

        ``ipc_dir`` holds the workers' ZeroMQ socket files.
        """
        try:
            path = await asyncio.to_thread(resolve_model_path, self.settings)
            tokenizer_path = await asyncio.to_thread(local_path, self.settings.tokenizer or path)
        except Exception as exc:  # noqa: BLE001  any failure is this model's, reported on /health
            self._fail(f"cannot prepare model {self.name}: {type(exc).__name__}: {exc}")
            return
        self.model_path, self.tokenizer_path = path, tokenizer_path
        if not os.path.isdir(os.path.expanduser(path)):
            # Spawning workers only to have each fail on a typo'd path would take seconds each.
            self._fail(f"model {self.name}: directory {path} does not exist")
            return
        set_worker_openmp_env()
        for worker in self.workers:
            worker.start(self._spec(worker, path, tokenizer_path, ipc_dir))
        self._progress = asyncio.create_task(self._log_progress())
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, tokenizer_path)
        except Exception as exc:  # noqa: BLE001  as above: the server keeps serving other models
            # Its workers could never serve: stop them rather than let them hold memory.
            await asyncio.gather(*(w.close(0) for w in self.workers))
            self._fail(f"cannot load the tokenizer of {self.name}: {type(exc).__name__}: {exc}")
            return
        self.token_texts = TokenTexts(tokenizer)
        self.tokenizer = tokenizer
        freeze_heap()  # the tokenizer and its tables: never walked by a full GC pass while serving

    def _spec(self, worker: WorkerClient, path: str, tokenizer_path: str, ipc_dir: str) -> WorkerSpec:
        slug = f"{self.name}-{worker.label}".replace("/", "_").replace(":", "_").replace("#", "_").replace("+", "_")
        threads = (self.settings.cpu_threads or self.cpu_threads) if splits_host_threads(worker.device) else None
        engine_kwargs = {**self.settings.engine_kwargs(), "tokenizer": tokenizer_path,
                         "data_parallel_rank": self.workers.index(worker), "lora_modules": dict(self.adapters) or None}
        group = self.groups[worker.label]
        if threads and len(group) == 1 and not self.settings.cpu_threads and self.settings.max_cpu_threads is None:
            engine_kwargs["max_cpu_threads"] = self.max_cpu_threads
        if len(group) > 1:
            index = self.first_group + list(self.groups).index(worker.label)
            engine_kwargs.update(group_engine_kwargs(group, self.distributed, index, threads,
                                                     self.settings.pipeline_parallel_size))
        return WorkerSpec(
            model_name=self.name,
            label=worker.label,
            device=worker.device,
            model_path=path,
            engine_kwargs=engine_kwargs,
            input_addr=f"ipc://{ipc_dir}/{slug}-in",
            output_addr=f"ipc://{ipc_dir}/{slug}-out",
            cpu_threads=threads,
            log_level=self.log_level,
            heartbeat_s=heartbeat.tick_s(self.heartbeat_timeout_s),
        )

    async def _log_progress(self, every_s: float = 15.0) -> None:
        """Big checkpoints take minutes: say which workers are still loading until none is."""
        start = time.monotonic()
        while True:
            await asyncio.sleep(every_s)
            loading = [w.label for w in self.workers if w.state == STARTING]
            if not loading or self.error:
                return
            logger.info("%s: still loading on %s (%.0fs)", self.name, ", ".join(loading), time.monotonic() - start)

    def _fail(self, message: str) -> None:
        logger.error("%s", message)
        self.error = message
        for worker in self.workers:
            if worker.state != FAILED:
                worker.state = FAILED
                worker.last_error = message

    def set_adapter(self, name: str, path: str | None) -> None:
        """Add (or with ``path`` None remove) an adapter requests may name; a worker started from now
        on (a restart) loads the new set at start."""
        if path is None:
            self.adapters.pop(name, None)
        else:
            self.adapters[name] = path
        for worker in self.workers:
            if worker.spec is not None:
                kwargs = {**worker.spec.engine_kwargs, "lora_modules": dict(self.adapters) or None}
                worker.spec = dataclasses.replace(worker.spec, engine_kwargs=kwargs)

    def ready_workers(self) -> list[WorkerClient]:
        if self.tokenizer is None or self.error is not None:
            return []
        return [w for w in self.workers if w.ready]

    @property
    def max_model_len(self) -> int | None:
        """The smallest context of the ready workers (they may differ in KV pool size)."""
        lens = [int(w.info["max_model_len"]) for w in self.ready_workers() if "max_model_len" in w.info]
        return min(lens) if lens else None

    async def close(self, timeout_s: float) -> None:
        if self._progress is not None:
            self._progress.cancel()
        await asyncio.gather(*(w.close(timeout_s) for w in self.workers))
