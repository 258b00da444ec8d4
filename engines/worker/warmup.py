"""What an engine finishes after it is ready: the C++ kernels it started without (their build was not
on disk: kernels/registry.py ``defer_builds``) and its CPU decode buckets (engines/worker/graphs.py).

One thread does it all, in order: build each deferred kernel (in a child process), select the kernels
again and swap the newly built ones into the model's layers; then the buckets. Kernels come first
because a bucket compiled before a swap would call the old kernel.

The buckets compile in a child process (engines/compile/child.py): one at the lowest CPU priority
beside a serving worker, else one per core as free memory allows (up to ``MAX_CHILDREN``: nothing is served meanwhile, as
with ``ready_when_warm``; bucket 1 and the larger buckets are two units, compiled side by side), each
saving its buckets as artifacts in the cache
(engines/compile/artifacts.py); this thread loads each one as it is reported (tens of ms of Python, no compiling) and installs it under the runner's step lock, so
it happens between steps and a step waits for the install only (one run of the bucket on padding).
Buckets compiled before (a restart, ``xinserve warmup``, a replica sharing the cache volume) are
loaded without a child; when all are, the engine loads them before it is ready (``settled`` at ready).

``background=False`` does the same work inline, before the engine is ready (offline benchmarks, tests
and ``xinserve warmup``). ``report()`` is what /health shows, with the progress.
"""

import importlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial

import torch

from xinserve.engines.compile import artifacts
from xinserve.engines.compile.child_process import CompileChild
from xinserve.engines.compile.spec import CompileSpec
from xinserve.engines.worker.gc_pauses import freeze_heap
from xinserve.engines.worker.graphs import DecodeGraphs, first_line
from xinserve.kernels.ops import OP_FUNCTIONS, KernelOps
from xinserve.kernels.registry import BUILT_FROM_SOURCE, KernelSelection, select

logger = logging.getLogger(__name__)

NICENESS = 10
MAX_CHILDREN = 2
GIB = 1 << 30
# A compile child's memory besides the weights: measured for the embedded model's compile, 0.55 GiB resident
# at its peak (torch, dynamo, inductor) and 0.5 GiB for the C++ compiler it runs; with room for a larger graph.
CHILD_OVERHEAD_BYTES = 3 * GIB // 2


class Warmup:
    """The deferred kernel builds and bucket compiles of one runner; ``version`` grows with every
    change /health should show (server/worker/engine_worker.py sends the runner's report again)."""

    def __init__(self, runner, background: bool, make_spec: Callable[[], CompileSpec] | None = None) -> None:
        self.runner = runner
        # What a compile child builds (engines/compile/spec.py), made once the kernels are final; None: nothing to compile
        self.make_spec = make_spec
        self.version = 0
        self.done = threading.Event()
        self.stopping = threading.Event()  # set by ``stop``: no further build or compile starts
        self.phase = "starting"  # for /health: "building kernels", "compiling", "loading", "settled"
        self.children: list[CompileChild] = []
        self.loaded: dict[str, Callable] = {}  # artifact name -> its compiled step (engines/compile/artifacts.py)
        self.prepared = threading.Event()  # set once ``artifacts.prepare_loading`` ran: loading may start
        self.thread: threading.Thread | None = None
        graphs = runner.decode_graphs
        compiles = graphs is not None and graphs.compiles and make_spec is not None
        pending = bool(runner.kernels.deferred) or compiles
        # Every bucket compiled before: loaded now, before ready (a few seconds), rather than after.
        warm = not runner.kernels.deferred and compiles and self._all_on_disk()
        if background and pending and not warm:
            self.thread = threading.Thread(target=self._run, name="xinserve-warmup", daemon=True)
            self.thread.start()  # first: its compile children start while this thread prepares (seconds)
        try:
            if compiles:
                artifacts.prepare_loading()
        finally:  # set even when it raised (the engine then fails to build): the thread must not wait forever
            self.prepared.set()
        if self.thread is None:
            self._work()

    @classmethod
    def for_engine(cls, config, runner, max_model_len: int) -> "Warmup":
        """An engine's warm-up: in the background unless ``warm_up_in_background`` is off."""
        return cls(runner, config.warm_up_in_background, partial(CompileSpec.of, config, runner, max_model_len))

    def stop(self) -> None:
        """Start nothing more (the engine is closing); a compile child is ended."""
        self.stopping.set()
        for child in self.children:
            child.stop()

    def report(self) -> dict:
        """For /health: the compile mode, whether the warm-up is over (``settled``: kernels built,
        every bucket compiled or given up), each decode bucket's state, and the progress."""
        graphs = self.runner.decode_graphs
        body = graphs.report() if graphs is not None else {"kind": "eager", "buckets": {}}
        finished = 0 if graphs is None else sum(state in ("compiled", "failed") or size in graphs.errors
                                                for size, state in graphs.states.items())
        progress = {"phase": "settled" if self.done.is_set() else self.phase, "done": finished,
                    "total": len(body["buckets"])}
        return {"mode": self.runner.compile_mode, "settled": self.done.is_set(), **body, "progress": progress}

    def _children_affordable(self, need: int) -> int:
        """How many compile children of ``need`` bytes each (``child_memory_bytes``) the free memory holds."""
        try:
            free = self.runner.platform.free_memory()
        except (OSError, RuntimeError):  # not Linux: no figure, no limit
            return MAX_CHILDREN
        return int(free // need)

    def _all_on_disk(self) -> bool:
        return set(self.runner.decode_graphs.states) <= set(artifacts.read_manifest(self.make_spec().directory()))

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)
        except OSError:  # not allowed here: load at the same priority
            pass
        self._work()

    def _work(self) -> None:
        try:
            if self.runner.kernels.deferred:
                self.phase = "building kernels"
                self._build_kernels()
            graphs = self.runner.decode_graphs
            if graphs is not None and graphs.compiles and self.make_spec is not None and not self.stopping.is_set():
                self._compile_buckets(graphs, self.make_spec())
        except Exception:  # a bug here must not take the engine down: it serves eagerly
            logger.exception("background warm-up stopped")
        finally:
            freeze_heap()  # the kernels and buckets loaded: never walked by a full GC pass
            self.done.set()
            self.version += 1

    def _build_kernels(self) -> None:
        old: KernelSelection = self.runner.kernels
        for name in old.deferred:
            logger.info("building the %s kernels in the background; the current choice serves meanwhile", name)
            try:
                importlib.import_module(BUILT_FROM_SOURCE[name]).build()
            except ImportError as exc:
                logger.warning("%s kernels unavailable: %s", name, exc)
        shapes, dtype, forced = self.runner.kernel_request
        # Not deferring now: a build that failed is reported as such ("not installed: cannot build ...").
        # Not timed: figures taken on this niced thread beside a serving engine are skewed (measured: the
        # C++ decode attention 2.08 ms vs the reference 1.59 ms here, 0.57 vs 0.68 ms in the foreground),
        # and a reference chosen that way pads compiled decode buckets to max_model_len (TPOT 297 ms at
        # c=32). The platform's preference order puts a built kernel first.
        new = select(self.runner.platform.kernel_preference, self.runner.device, dtype, shapes, forced, time_candidates=False)
        swapped = [op for op, name in new.chosen.items() if name in old.deferred and old.chosen.get(op) != name]
        functions = {f: getattr(new.ops, f) for op in swapped for f in OP_FUNCTIONS[op]}
        merged = replace(new, chosen={op: new.chosen[op] if op in swapped else name for op, name in old.chosen.items()},
                         ops=replace(old.ops, **functions), deferred=[])
        with self.runner.step_lock:
            swap_ops(self.runner.model, old.ops, merged.ops)
            self.runner.kernels = merged
        self.version += 1
        logger.info("kernels swapped in between steps: %s", ", ".join(f"{op}={new.chosen[op]}" for op in swapped)
                    or "none (the current choice stays)")

    def _compile_buckets(self, graphs: DecodeGraphs, spec: CompileSpec) -> None:
        """Load the buckets compiled before; start children for the others and load each as it finishes."""
        directory = spec.directory()
        self.phase = "loading"
        finished = artifacts.read_manifest(directory)
        for size in spec.order:
            if size in finished and not self.stopping.is_set():
                self._take(graphs, directory, size, finished[size])
        missing = [size for size in spec.order if size not in finished]
        if not missing or self.stopping.is_set():
            return
        self.phase = "compiling"
        need = child_memory_bytes(self.runner.model)
        affordable = self._children_affordable(need)
        if affordable == 0:  # a child would not fit beside this worker: eager rather than out of memory
            reason = f"not compiled: a compile child needs ~{need / GIB:.1f} GiB (a copy of the weights), less is free"
            logger.warning("decode buckets %s run eagerly: %s", missing, reason)
            for size in missing:
                graphs.states[size], graphs.errors[size] = "failed", reason
            return
        orders = child_orders(spec, missing, affordable)
        logger.info("compiling decode buckets %s in %d child process(es) into %s", missing, len(orders), directory)
        self.children = [CompileChild(replace(spec, order=order), directory) for order in orders]
        waiting = set(missing)
        for event in merged_events(self.children):
            size = event["bucket"]
            if self.stopping.is_set():
                break
            if event["event"] == "compiling":
                graphs.states[size] = "compiling"
                self.version += 1
            elif event["event"] == "done" and graphs.states.get(size) in ("eager", "compiling"):
                self._take(graphs, directory, size, event)
            if event["event"] == "done":
                waiting.discard(size)
            if not waiting:  # settled now, not once the children have exited (a second or more)
                self.done.set()
                self.version += 1
                break
        errors = [error for error in (child.finish() for child in self.children) if error is not None]
        for size in missing:  # what the children left undone (one failed, or the engine is closing)
            if graphs.states[size] == "compiling" or (graphs.states[size] == "eager" and size not in graphs.errors):
                graphs.states[size] = "failed"
                graphs.errors[size] = errors[0] if errors else "not compiled: the engine closed"
        if errors:
            logger.warning("the compile process failed (%s); buckets it did not finish run eagerly", errors[0])
        logger.info("decode buckets %s run compiled; the others eagerly", sorted(graphs.steps))

    def _take(self, graphs: DecodeGraphs, directory, size: int, entry: dict) -> None:
        """One bucket's outcome: load and install a compiled one, else note why it stays eager."""
        state = entry.get("state")
        if state != "compiled":
            graphs.states[size], graphs.errors[size] = ("eager" if state == "eager" else "failed"), entry.get("error")
            self.version += 1
            return
        self.prepared.wait()
        try:
            start = time.perf_counter()
            name = entry.get("artifact") or f"bucket-{size}"
            if name not in self.loaded:  # buckets that share an artifact load it once
                self.loaded[name] = artifacts.load(directory, name)  # no lock: steps go on meanwhile
            compiled = self.loaded[name]
            loaded_s = time.perf_counter() - start
            with self.runner.step_lock, torch.inference_mode():
                graphs.install(size, compiled)
            logger.info("decode bucket %d loaded in %.0f ms and installed", size, loaded_s * 1e3)
        except Exception as exc:  # noqa: BLE001  a stale or unreadable artifact: this bucket stays eager
            logger.warning("decode bucket %d could not be loaded (%s: %s); it runs eagerly", size,
                           type(exc).__name__, first_line(exc))
            graphs.states[size], graphs.errors[size] = "failed", first_line(exc)
        self.version += 1


def child_memory_bytes(model: torch.nn.Module) -> int:
    """What one compile child holds: its own copy of the weights (it loads the model as the worker did), and
    the compiler's working set, ``CHILD_OVERHEAD_BYTES``; its KV pool is allocated but never touched."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors) + CHILD_OVERHEAD_BYTES


def child_orders(spec: CompileSpec, missing: list[int], affordable: int = MAX_CHILDREN) -> list[tuple[int, ...]]:
    """The buckets each compile child compiles, in order: the units of ``missing`` dealt out to
    ``children_for`` children, at most ``affordable`` (engines/compile/artifacts.py ``units``)."""
    groups = artifacts.units(missing)
    count = min(children_for(spec, len(groups)), max(1, affordable))
    return [tuple(size for _, sizes in groups[i::count] for size in sizes) for i in range(count)]


def children_for(spec: CompileSpec, units: int) -> int:
    """Compile children to start for ``units`` units to compile: one beside a serving worker (it takes idle
    CPU only); otherwise one per core, up to ``MAX_CHILDREN``."""
    if spec.low_priority:
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(units, cores, MAX_CHILDREN))


def merged_events(children: list[CompileChild]) -> Iterator[dict]:
    """The children's events as they come, until every child has exited."""
    events: queue.Queue = queue.Queue()

    def read(child: CompileChild) -> None:
        try:
            for event in child.events():
                events.put(event)
        finally:
            events.put(None)

    for child in children:
        threading.Thread(target=read, args=(child,), name="xinserve-compile-events", daemon=True).start()
    running = len(children)
    while running:
        event = events.get()
        if event is None:
            running -= 1
        else:
            yield event


def swap_ops(model: torch.nn.Module, old: KernelOps, new: KernelOps) -> None:
    """Point every layer built with ``old`` at ``new`` (layers keep their ``KernelOps`` as ``ops``)."""
    for module in model.modules():
        if getattr(module, "ops", None) is old:
            module.ops = new
