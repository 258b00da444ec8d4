"""The compile child: ``python -m xinserve.engines.compile.child PARENT_PID SPEC_PATH``.

Rebuilds the worker's runner from the spec (engines/compile/spec.py: the same model, settings, kernels
and KV pool shape; the pool is allocated, never touched but for the padding rows' scratch block), then
compiles each bucket of the spec's order into the bucket directory (engines/compile/artifacts.py),
printing one JSON line per event on stdout for the worker: {"bucket": n, "event": "compiling"}, then
{"bucket": n, "event": "done", **manifest entry}. Each bucket is compiled under a lock of its own: a
bucket another process (a sibling child, a replica on the same cache) finished is reported done at once.

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

TIMING_ITERATIONS = 5


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
    built = None  # (model, KV cache, step buffers), made for the first bucket that needs compiling
    for size in spec.order:
        # One compiler per bucket: sibling children and replicas sharing the cache split the work.
        with artifacts.lock(directory, f"bucket-{size}"):
            entry = artifacts.read_manifest(directory).get(size)
            if entry is None:
                built = built or build(spec)
                emit(size, "compiling")
                entry = compile_bucket(spec, directory, *built, size)
                if parent_gone():  # its compilers were stopped: the outcome says nothing of the bucket
                    sys.exit(1)
                artifacts.record(directory, size, entry)
        emit(size, "done", **entry)


def build(spec: CompileSpec) -> tuple:
    """The worker's model, a KV pool of its shape and the step buffers, as the worker made them."""
    # Imported here: the runner imports the model code, which this module's importers need not.
    from xinserve.engines.parallel.tp_runner import make_runner
    from xinserve.engines.platforms import get_platform
    from xinserve.engines.worker.decode_buckets import DecodeBuffers

    os.environ["XINSERVE_KERNEL_TIMING"] = "off"  # every kernel is forced to the worker's choice anyway
    torch.set_num_threads(spec.threads)
    platform = get_platform(spec.config.device)
    runner = make_runner(spec.config, platform, spec.block_size, list(spec.eos_token_ids))
    with torch.inference_mode(spec.kv_inference):  # made as the worker's was: the compiled code is specialised to it
        runner.allocate_kv_cache(spec.config.num_kv_blocks)
    with torch.inference_mode():  # as the worker's buffers are made (engines/worker/graphs.py)
        buffers = DecodeBuffers(list(spec.sizes), spec.max_model_len, spec.block_size, runner.scratch_block,
                                platform.device)
    return runner.model, runner.kv_cache, buffers


@torch.inference_mode()
def compile_bucket(spec: CompileSpec, directory, model, kv_cache, buffers, size: int) -> dict:
    """Compile, time against eager (mode "auto"), save; the manifest entry."""
    args = (model, kv_cache, *buffers.inputs(size))
    buffers.pad(size)
    start = time.perf_counter()
    try:
        compiled = torch.compile(decode_step, fullgraph=True, dynamic=False).aot_compile((args, {}))
        compile_s = round(time.perf_counter() - start, 2)
        compiled.disable_guard_check()  # its guards hold for these very inputs
        eager_ms, compiled_ms = median_ms(decode_step, args), median_ms(compiled, args)
    except Exception as exc:  # noqa: BLE001  inductor can fail in many ways: this bucket stays eager
        logger.warning("decode bucket %d failed to compile: %s: %s", size, type(exc).__name__, exc)
        return {"state": "failed", "error": f"{type(exc).__name__}: {first_line(exc)}"}
    entry = {"compile_s": compile_s, "eager_ms": eager_ms, "compiled_ms": compiled_ms}
    logger.info("decode bucket %d compiled in %.1f s: %.3f ms compiled vs %.3f ms eager", size, compile_s,
                compiled_ms, eager_ms)
    if spec.mode == "auto" and compiled_ms >= eager_ms:
        return {"state": "eager", "error": "eager measured faster", **entry}
    artifacts.save(compiled, directory, size)
    return {"state": "compiled", "error": None, **entry}


def median_ms(function, args: tuple) -> float:
    function(*args)
    times = []
    for _ in range(TIMING_ITERATIONS):
        start = time.perf_counter()
        function(*args)
        times.append(time.perf_counter() - start)
    return round(sorted(times)[len(times) // 2] * 1e3, 4)


if __name__ == "__main__":
    main()
