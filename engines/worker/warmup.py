"""What an engine finishes after it is ready: the C++ kernels it started without (their build was not
on disk: kernels/registry.py ``defer_builds``) and its CPU decode buckets (engines/worker/graphs.py).

One thread does it all, in order: build each deferred kernel, select the kernels again and swap the
newly built ones into the model's layers; then compile the buckets one at a time, the latest step's
bucket first, then by use (``DecodeGraphs.next_to_compile``). Kernels come first because a bucket
compiled before a swap would trace the old kernel. Each swap takes the runner's step lock, so it
happens between steps and a step never waits for a compile, only for the swap itself.

The thread runs at a lower priority (nice +10, which inductor's and the C++ compiler's child
processes inherit); a compile still takes the GIL in turns with the steps, so steps run slower while
buckets compile (docs/performance.md says by how much). ``background=False`` does the same work inline, before
the engine is ready (offline benchmarks and tests that want every bucket compiled at once).
"""

import importlib
import logging
import os
import threading
from dataclasses import replace

import torch

from xinserve.engines.worker.graphs import DecodeGraphs, first_line
from xinserve.kernels.ops import OP_FUNCTIONS, KernelOps
from xinserve.kernels.registry import BUILT_FROM_SOURCE, KernelSelection, select

logger = logging.getLogger(__name__)

NICENESS = 10


class Warmup:
    """The deferred kernel builds and bucket compiles of one runner; ``version`` grows with every
    change /health should show (server/worker/engine_worker.py sends the runner's report again)."""

    def __init__(self, runner, background: bool) -> None:
        self.runner = runner
        self.version = 0
        self.done = threading.Event()
        self.stopping = threading.Event()  # set by ``stop``: no further build or compile starts
        self.thread: threading.Thread | None = None
        graphs = runner.decode_graphs
        pending = bool(runner.kernels.deferred) or (graphs is not None and graphs.compiler is not None)
        if background and pending:
            self.thread = threading.Thread(target=self._run, name="xinserve-warmup", daemon=True)
            self.thread.start()
        else:
            self._work()

    def stop(self) -> None:
        """Start nothing more (the engine is closing); a compile under way finishes on its own."""
        self.stopping.set()

    def report(self) -> dict:
        """For /health: the compile mode, whether the warm-up is over (``settled``: kernels built,
        every bucket compiled or given up), and each decode bucket's state."""
        graphs = self.runner.decode_graphs
        body = graphs.report() if graphs is not None else {"kind": "eager", "buckets": {}}
        return {"mode": self.runner.compile_mode, "settled": self.done.is_set(), **body}

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)
        except OSError:  # not allowed here: compile at the same priority
            pass
        self._work()

    def _work(self) -> None:
        try:
            if self.runner.kernels.deferred:
                self._build_kernels()
            graphs = self.runner.decode_graphs
            if graphs is not None and graphs.compiler is not None and not self.stopping.is_set():
                self._compile_buckets(graphs)
        except Exception:  # a bug here must not take the engine down: it serves eagerly
            logger.exception("background warm-up stopped")
        finally:
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

    def _compile_buckets(self, graphs: DecodeGraphs) -> None:
        done = 0
        while not self.stopping.is_set() and (size := graphs.next_to_compile()) is not None:
            done += 1
            graphs.states[size] = "compiling"
            self.version += 1
            logger.info("compiling the decode step for batch bucket %d (%d of %d)", size, done, len(graphs.states))
            try:
                compiled = graphs.compiler(size)
                if compiled is None:
                    graphs.states[size], graphs.errors[size] = "eager", "eager measured faster"
                else:
                    with self.runner.step_lock, torch.inference_mode():
                        graphs.install(size, compiled)
            except Exception as exc:  # noqa: BLE001  inductor can fail in many ways: this bucket stays eager
                logger.warning("torch.compile of the decode step for bucket %d failed (%s: %s); it runs eagerly",
                               size, type(exc).__name__, first_line(exc))
                graphs.states[size], graphs.errors[size] = "failed", first_line(exc)
            self.version += 1
        logger.info("decode buckets %s run compiled; the others eagerly", sorted(graphs.steps))


def swap_ops(model: torch.nn.Module, old: KernelOps, new: KernelOps) -> None:
    """Point every layer built with ``old`` at ``new`` (layers keep their ``KernelOps`` as ``ops``)."""
    for module in model.modules():
        if getattr(module, "ops", None) is old:
            module.ops = new
