"""The compile child: ``python -m xinserve.engines.compile.child PARENT_PID SPEC_PATH``.

Rebuilds the worker's runner from the spec (engines/compile/spec.py: the same model, settings, kernels
and KV pool shape; the pool is allocated, never touched but for the padding rows' scratch block), then
compiles the buckets of the spec's order, unit by unit (bucket 1 alone, the larger ones in one compile:
engines/compile/artifacts.py ``units``), into the bucket directory, printing one JSON line per event on
stdout for the worker: {"bucket": n, "event": "compiling"}, then {"bucket": n, "event": "done",
**manifest entry}. Each unit is compiled under a lock of its own: buckets another process (a sibling
child, a replica on the same cache) finished are reported done at once.

While its worker serves (ready first), it runs at the lowest CPU priority there is (SCHED_IDLE, else
nice 19), which inductor's C++ compiler processes inherit: it takes only what the serving process leaves
idle (and whatever else runs on the machine: under other load it waits). It is tied to its parent like
the C++ kernel build (kernels/cpu/build_process.py): the parent's exit ends it and its compilers.
"""

import json
import logging
import os
import pickle
import sys
import time

import torch

from xinserve.engines.compile import artifacts
from xinserve.engines.compile.decode_step import decode_step
from xinserve.engines.compile.spec import CompileSpec
from xinserve.engines.worker.graphs import first_line
from xinserve.kernels.cpu.build_process import parent_gone, tie_to_parent

logger = logging.getLogger(__name__)

TIMING_ITERATIONS = 15
# Mode "auto" keeps a bucket eager only where eager measured clearly faster. The timing runs beside a sibling
# child's compile (its compilers take a core): seen here, both steps at ~40 ms where they take 0.3-0.7 ms
# alone (a median of 5 runs), and bucket 1 kept eager by a 0.005 ms tie, in the manifest for good.
EAGER_MARGIN = 1.1


def lower_priority() -> str:
    """SCHED_IDLE where allowed (Linux), else nice 19; returns which."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return "SCHED_IDLE"
    except (AttributeError, OSError):
        os.nice(19)
        return "nice 19"


def emit(size: int, event: str, **entry) -> None:
    print(json.dumps({"bucket": size, "event": event, **entry}), flush=True)


def main() -> None:
    tie_to_parent(int(sys.argv[1]))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [compile child] %(message)s")
    with open(sys.argv[2], "rb") as handle:
        spec, directory = pickle.load(handle)
    priority = lower_priority() if spec.low_priority else "normal priority"
    logger.info("compiling decode buckets %s into %s (%s)", list(spec.order), directory, priority)
    built = None  # (model, KV cache, step buffers), made for the first unit that needs compiling
    for unit, sizes in artifacts.units(spec.order):
        # One compiler per unit: sibling children and replicas sharing the cache split the work.
        with artifacts.lock(directory, unit):
            todo = [size for size in sizes if size not in artifacts.read_manifest(directory)]
            if todo:
                built = built or build(spec)
                for size in todo:
                    emit(size, "compiling")
                entries = compile_unit(spec, directory, *built, unit, todo)
                if parent_gone():  # its compilers were stopped: the outcome says nothing of the buckets
                    sys.exit(1)
                for size, entry in entries.items():
                    artifacts.record(directory, size, entry)
            finished = artifacts.read_manifest(directory)
        for size in sizes:
            emit(size, "done", **finished[size])


def build(spec: CompileSpec) -> tuple:
    """The worker's model, a KV pool of its shape and the step buffers, as the worker made them."""
    # Imported here: the runner imports the model code, which this module's importers need not.
    from xinserve.engines.parallel.tp_runner import make_runner
    from xinserve.engines.platforms import get_platform
    from xinserve.engines.worker.decode_buckets import DecodeBuffers

    os.environ["XINSERVE_KERNEL_TIMING"] = "off"  # every kernel is forced to the worker's choice anyway
    artifacts.trust_cpu_flags()
    torch.set_num_threads(spec.threads)
    platform = get_platform(spec.config.device)
    runner = make_runner(spec.config, platform, spec.block_size, list(spec.eos_token_ids))
    with torch.inference_mode(spec.kv_inference):  # made as the worker's was: the compiled code is specialised to it
        runner.allocate_kv_cache(spec.config.num_kv_blocks)
    with torch.inference_mode():  # as the worker's buffers are made (engines/worker/graphs.py)
        buffers = DecodeBuffers(list(spec.sizes), spec.max_model_len, spec.block_size, runner.scratch_block,
                                platform.device)
    return runner.model, runner.kv_cache, buffers


def compile_unit(spec: CompileSpec, directory, model, kv_cache, buffers, unit: str, sizes: list[int]) -> dict[int, dict]:
    """Each bucket's manifest entry. The shared unit compiles once for all its buckets (its batch size
    symbolic); where that fails, each of them alone."""
    if unit == artifacts.SHARED:
        entries = compile_shared(spec, directory, model, kv_cache, buffers, sizes)
        if entries is not None:
            return entries
    return {size: compile_static(spec, directory, model, kv_cache, buffers, size) for size in sizes}


@torch.inference_mode()
def compile_shared(spec: CompileSpec, directory, model, kv_cache, buffers, sizes: list[int]) -> dict[int, dict] | None:
    """One compile for every bucket of ``sizes`` (all above 1), traced at their median with every size
    symbolic but the KV pool's; None when it fails (the buckets then compile one by one)."""
    example = sorted(sizes)[len(sizes) // 2]
    args = (model, kv_cache, *buffers.inputs(example))
    buffers.pad(example)
    start = time.perf_counter()
    try:
        torch._dynamo.mark_static(kv_cache)  # the pool's shape is in the key: nothing gained by a symbol
        # Float arguments (the attention scale, norms' eps) stay constants: made tensors, they would restart
        # the analysis, which an ahead-of-time compile cannot.
        with torch._dynamo.config.patch(specialize_float=True), artifacts.cpu_turn(directory, exclusive=False):
            compiled = torch.compile(decode_step, fullgraph=True, dynamic=True).aot_compile((args, {}))
        compile_s = round(time.perf_counter() - start, 2)
        compiled.disable_guard_check()  # its guards hold for these inputs at every size here
    except Exception as exc:  # noqa: BLE001  a model that cannot trace with a symbolic batch
        logger.warning("decode buckets %s failed to compile together (%s: %s); compiling each alone", sizes,
                       type(exc).__name__, first_line(exc))
        return None
    logger.info("decode buckets %s compiled together in %.1f s", sizes, compile_s)
    entries = {}
    with artifacts.cpu_turn(directory, exclusive=True):
        for size in sizes:
            buffers.pad(size)
            entries[size] = judged(spec, compiled, (model, kv_cache, *buffers.inputs(size)), size, compile_s,
                                   artifacts.SHARED)
    if any(entry["state"] == "compiled" for entry in entries.values()):
        artifacts.save(compiled, directory, artifacts.SHARED)
    return entries


@torch.inference_mode()
def compile_static(spec: CompileSpec, directory, model, kv_cache, buffers, size: int) -> dict:
    """Compile one bucket at its own size, time it against eager, save it; the manifest entry."""
    args = (model, kv_cache, *buffers.inputs(size))
    buffers.pad(size)
    start = time.perf_counter()
    try:
        with artifacts.cpu_turn(directory, exclusive=False):
            compiled = torch.compile(decode_step, fullgraph=True, dynamic=False).aot_compile((args, {}))
        compile_s = round(time.perf_counter() - start, 2)
        compiled.disable_guard_check()  # its guards hold for these very inputs
    except Exception as exc:  # noqa: BLE001  inductor can fail in many ways: this bucket stays eager
        logger.warning("decode bucket %d failed to compile: %s: %s", size, type(exc).__name__, exc)
        return {"state": "failed", "error": f"{type(exc).__name__}: {first_line(exc)}"}
    name = f"bucket-{size}"  # bucket 1's unit too
    with artifacts.cpu_turn(directory, exclusive=True):
        entry = judged(spec, compiled, args, size, compile_s, name)
    if entry["state"] == "compiled":
        artifacts.save(compiled, directory, name)
    return entry


def judged(spec: CompileSpec, compiled, args: tuple, size: int, compile_s: float, name: str) -> dict:
    """The entry of bucket ``size`` run by ``compiled`` (saved as ``name``): timed against eager on its
    inputs ``args``; mode "auto" keeps it eager where eager measured clearly faster (``EAGER_MARGIN``)."""
    eager_ms, compiled_ms = timings(compiled, args)
    entry = {"compile_s": compile_s, "eager_ms": eager_ms, "compiled_ms": compiled_ms}
    logger.info("decode bucket %d: %.3f ms compiled vs %.3f ms eager", size, compiled_ms, eager_ms)
    if spec.mode == "auto" and compiled_ms > eager_ms * EAGER_MARGIN:
        return {"state": "eager", "error": "eager measured faster", **entry}
    return {"state": "compiled", "error": None, "artifact": name, **entry}


def timings(compiled, args: tuple) -> tuple[float, float]:
    """(eager ms, compiled ms) of one step on ``args``: the fastest of ``TIMING_ITERATIONS`` runs each, taken
    in turns, so that a stall (a sibling's compiler taking the core) hits both alike and the fastest run is
    the undisturbed one."""
    functions = (decode_step, compiled)
    best = [float("inf"), float("inf")]
    for function in functions:
        function(*args)
    for _ in range(TIMING_ITERATIONS):
        for i, function in enumerate(functions):
            start = time.perf_counter()
            function(*args)
            best[i] = min(best[i], time.perf_counter() - start)
    return round(best[0] * 1e3, 4), round(best[1] * 1e3, 4)


if __name__ == "__main__":
    main()
    # Every event is out and every artifact saved: end now. An interpreter's exit walks the heap of torch,
    # inductor and the model (1-2 CPU s: engines/worker/process_exit.py), while the worker, settled once
    # the last bucket was reported, already serves beside it.
    sys.stdout.flush()
    os._exit(0)
