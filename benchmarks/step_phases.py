"""Where an engine step's time goes on the host: a stopwatch set on one engine instance from outside
(production code carries no timer), for the device script (tests/gpu/bench_cuda.py) and any benchmark.

Phases, each the wall time of the call named, summed over the steps run while open:
- ``schedule``: ``Scheduler.schedule``; ``inputs``: ``ModelRunner._prepare`` (the step's host arrays and
  their copies to the device); ``sample``: ``ModelRunner._sample`` (it waits for the device: the copy of
  the sampled tokens); ``update``: ``Scheduler.update`` (the tokens into the sequences, the outputs);
- ``output``: encoding the step's outputs as the worker's message (``server/worker/messages.py``);
- ``launch``: ``ModelRunner.forward`` as called (a graph replay or the eager kernels' launches: host time);
  ``device``: the wait for the device right after it, so launch + device is the forward's wall time;
- ``step``: the whole ``engine.step()`` plus ``output``.
``host_ms`` is what is left of a step once the device wait is taken out: the work to overlap with it.
"""

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

PHASES = ("schedule", "inputs", "launch", "device", "sample", "update", "output")


@dataclass
class Phases:
    seconds: Counter = field(default_factory=Counter)
    steps: int = 0

    def per_step_ms(self) -> dict[str, float]:
        """Each phase's mean milliseconds per step, the step's, and ``host_ms`` (the step less the wait)."""
        steps = max(self.steps, 1)
        ms = {name: 1e3 * self.seconds[name] / steps for name in (*PHASES, "step")}
        ms["host_ms"] = ms["step"] - ms["device"]
        return ms


@contextmanager
def step_phases(engine) -> Iterator[Phases]:
    """While open, ``engine.step()`` is timed phase by phase into the ``Phases`` yielded; the wrappers are
    instance attributes, removed on exit."""
    from xinserve.server.worker import messages

    phases, runner, scheduler = Phases(), engine.runner, engine.scheduler
    originals = {(runner, "_prepare"): "inputs", (runner, "_sample"): "sample", (scheduler, "schedule"): "schedule",
                 (scheduler, "update"): "update"}
    forward, step = runner.forward, engine.step

    def timed(function, name):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                phases.seconds[name] += time.perf_counter() - start
        return call

    def timed_forward(batch):
        start = time.perf_counter()
        logits = forward(batch)
        launched = time.perf_counter()
        runner.platform.synchronize()
        phases.seconds["launch"] += launched - start
        phases.seconds["device"] += time.perf_counter() - launched
        return logits

    def timed_step():
        start = time.perf_counter()
        result = step()
        encoded = time.perf_counter()
        messages.encode(messages.Outputs(result.outputs))
        end = time.perf_counter()
        phases.seconds["output"] += end - encoded
        phases.seconds["step"] += end - start
        phases.steps += 1
        return result

    for (owner, attr), name in originals.items():
        setattr(owner, attr, timed(getattr(owner, attr), name))
    runner.forward, engine.step = timed_forward, timed_step
    try:
        yield phases
    finally:
        for owner, attr in [*originals, (runner, "forward"), (engine, "step")]:
            delattr(owner, attr)  # back to the class's method
