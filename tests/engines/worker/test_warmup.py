"""Ready first, warm up in the background (engines/worker/warmup.py): an engine serves correct greedy tokens
while its decode buckets compile and while its C++ kernel builds; each is swapped in between steps
with identical outputs; a failing compile leaves its bucket ``failed`` and eager; /health (the
worker's description) and the worker's ``InfoUpdate`` show the states.

The compile child and the builder are test doubles that block on an event, so the test decides when a
compile or a build ends (no sleeps, no inductor): the "compiled" step is the eager one itself
(tests/engines/worker/compile_doubles.py), which is what makes outputs comparable token for token."""

import sys
import threading
import time

import pytest
import torch
import zmq

import xinserve.engines.worker.graphs
import xinserve.kernels.cpu.cpp_build
from tests.engines.worker.compile_doubles import TIMEOUT_S, use_doubles
from xinserve.engines import LLM, SamplingParams
from xinserve.server.pool.worker_client import WorkerClient
from xinserve.server.worker import messages
from xinserve.server.worker.engine_worker import WorkerLoop

BUCKETS = [1, 4, 9]
OPTIONS = {"block_size": 4, "num_kv_blocks": 60, "max_num_seqs": 9, "max_model_len": 64}
# The bucket tests keep the reference attention, so that no C++ build runs before their compiles.
REFERENCE = {"decode_attention": "reference"}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("llama", num_layers=1, max_position_embeddings=64)


@pytest.fixture(scope="module")
def eager(model):
    return LLM(model, compile="off", **OPTIONS)


@pytest.fixture
def blocking(monkeypatch):
    monkeypatch.setattr(xinserve.engines.worker.graphs, "bucket_sizes", lambda max_num_seqs: BUCKETS)
    return use_doubles(monkeypatch, released=False)


def prompts(count: int) -> list[list[int]]:
    return [[5 + i, 17, 23 + 2 * i, 9, 40 + i] for i in range(count)]


def tokens(llm: LLM, count: int) -> list[list[int]]:
    return [r.token_ids for r in llm.generate(prompts(count), GREEDY)]


def states(llm: LLM) -> dict[str, str]:
    return {b: s["state"] for b, s in llm.engine.warmup.report()["buckets"].items()}


def test_ready_before_buckets_compile_serving_greedy_tokens_then_swapping_them_in(model, eager, blocking):
    llm = LLM(model, compile="on", kernels=REFERENCE, **OPTIONS)  # returns while the first bucket is still compiling
    compiler = blocking.latest()
    compiler.wait_compiling(llm.engine.warmup)
    assert states(llm) == {"1": "compiling", "4": "eager", "9": "eager"}
    graphs = llm.engine.runner.decode_graphs
    assert tokens(llm, 3) == tokens(eager, 3)  # served eagerly meanwhile, bucket 4 used
    assert graphs.steps_run == 0 and not llm.engine.warmup.report()["settled"]
    compiler.release.set()
    assert llm.engine.warmup.done.wait(TIMEOUT_S)
    # In the order given at the child's start: the most used (none yet), then the smallest.
    assert compiler.calls == [1, 4, 9]
    assert states(llm) == {"1": "compiled", "4": "compiled", "9": "compiled"}
    assert llm.engine.warmup.report()["settled"]
    assert tokens(llm, 3) == tokens(eager, 3)  # identical once swapped in
    assert graphs.bucket_runs[4] > 0


def test_a_failing_compile_marks_its_bucket_failed_and_the_eager_path_serves_it(model, eager, blocking):
    blocking.failing = {4}
    llm = LLM(model, compile="on", kernels=REFERENCE, **OPTIONS)
    compiler = blocking.latest()
    compiler.release.set()
    assert llm.engine.warmup.done.wait(TIMEOUT_S)
    report = llm.engine.warmup.report()
    assert report["buckets"]["4"] == {"state": "failed", "error": "RuntimeError: inductor broke on bucket 4"}
    assert states(llm) == {"1": "compiled", "4": "failed", "9": "compiled"}
    graphs = llm.engine.runner.decode_graphs
    assert tokens(llm, 3) == tokens(eager, 3) and graphs.bucket_runs[4] == 0  # bucket 4 ran eagerly
    assert tokens(llm, 1) == tokens(eager, 1) and graphs.bucket_runs[1] > 0


def test_ready_does_not_wait_for_the_cpp_build_which_swaps_in_between_steps(model, eager, monkeypatch):
    # Timing stays on: the swap after the build is chosen by preference order (cpp first), never timed
    # on the niced warm-up thread, whose figures once put the reference first.
    on_disk = threading.Event()
    release = threading.Event()
    real_build = xinserve.kernels.cpu.cpp_build.build
    # Built for real first (cached by its sources' hash): what is tested is when the engine waits for
    # the build, not how long a cold compile takes on a loaded machine.
    real_build()

    def build():
        assert release.wait(TIMEOUT_S)
        real_build()
        on_disk.set()

    monkeypatch.setattr(xinserve.kernels.cpu.cpp_build, "built", on_disk.is_set)
    monkeypatch.setattr(xinserve.kernels.cpu.cpp_build, "build", build)
    imported = sys.modules.pop("xinserve.kernels.cpu.cpp", None)  # importing xinserve.kernels.cpu.cpp builds it: not before ready
    llm = LLM(model, compile="off", **OPTIONS)  # returns while the build waits
    assert "xinserve.kernels.cpu.cpp" not in sys.modules
    if imported is not None:  # loaded again later, it would register its torch op twice
        sys.modules["xinserve.kernels.cpu.cpp"] = imported
    runner = llm.engine.runner
    assert runner.kernels.chosen["decode_attention"] == "reference" and runner.kernels.deferred == ["cpp"]
    assert ("cpp", "not built yet: building in the background") in runner.kernels.rejected["decode_attention"]
    assert tokens(llm, 3) == tokens(eager, 3)  # the reference serves meanwhile
    release.set()
    assert llm.engine.warmup.done.wait(TIMEOUT_S)
    from xinserve.kernels.cpu import cpp

    assert runner.kernels.chosen["decode_attention"] == "cpp" and not runner.kernels.deferred
    assert "decode_attention" not in runner.kernels.timings_ms
    layer_ops = {m.ops for m in runner.model.modules() if hasattr(m, "ops")}
    assert layer_ops == {runner.kernels.ops} and runner.kernels.ops.paged_decode_attention is cpp.paged_decode_attention
    assert tokens(llm, 3) == tokens(eager, 3)


def test_the_worker_sends_bucket_states_and_its_health_shows_them(model, blocking):
    llm = LLM(model, compile="on", kernels=REFERENCE, **OPTIONS)
    compiler = blocking.latest()
    compiler.wait_compiling(llm.engine.warmup)
    ctx = zmq.Context()
    try:
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        pull.bind("inproc://warmup-out")
        push.connect("inproc://warmup-out")
        loop = WorkerLoop(llm.engine, ctx.socket(zmq.PULL), push, "test")
        client = WorkerClient("m", "cpu", "cpu", max_num_seqs=9, max_waiting_requests=0)
        client.info = {"decode_graphs": {"buckets": {}}}

        def delivered() -> dict:
            loop._report_warmup()
            assert pull.poll(TIMEOUT_S * 1000)
            client._dispatch(messages.decode_from_worker(pull.recv()))
            return client.describe()["info"]["decode_graphs"]

        health = delivered()
        assert health["mode"] == "on" and health["kind"] == "compiled" and not health["settled"]
        assert health["buckets"]["1"] == {"state": "compiling", "error": None}
        assert client.describe()["kernels"]["decode_attention"]["chosen"] in ("cpp", "reference")
        compiler.release.set()
        assert llm.engine.warmup.done.wait(TIMEOUT_S)
        health = delivered()
        assert health["settled"] and {s["state"] for s in health["buckets"].values()} == {"compiled"}
        loop._report_warmup()  # nothing changed: nothing sent
        assert not pull.poll(0)
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize(("low_priority", "cores", "orders"), [
    (True, 2, [(8, 2, 4, 1)]),  # beside a serving worker: one child takes every unit, in order
    (False, 2, [(8, 2, 4), (1,)]),  # nothing served meanwhile: bucket 1 and the larger ones side by side
    (False, 1, [(8, 2, 4, 1)]),
])
def test_the_compile_units_are_dealt_to_the_children(monkeypatch, low_priority, cores, orders):
    from xinserve.engines.worker import warmup

    monkeypatch.setattr(warmup.os, "sched_getaffinity", lambda pid: set(range(cores)))
    spec = type("Spec", (), {"low_priority": low_priority})()
    assert warmup.child_orders(spec, [8, 1, 2, 4]) == orders


def test_a_settled_warm_up_leaves_the_heap_frozen_so_full_gc_passes_stay_short(model, blocking):
    """What the warm-up loaded (kernels, buckets) joins the permanent generation (engines/worker/gc_pauses.py):
    a full collection no longer walks it."""
    import gc

    gc.unfreeze()
    try:
        llm = LLM(model, compile="on", kernels=REFERENCE, **OPTIONS)
        blocking.latest().release.set()
        assert llm.engine.warmup.done.wait(TIMEOUT_S)
        deadline = time.monotonic() + TIMEOUT_S
        while gc.get_freeze_count() == 0:  # frozen just after ``done`` is set, on the warm-up thread
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert gc.get_freeze_count() > 10_000  # torch, the model and the test's modules: all of the heap
    finally:
        gc.unfreeze()


def test_a_compile_child_that_would_not_fit_in_memory_is_not_started(model, eager, blocking, monkeypatch):
    """Each child loads its own copy of the weights: with less memory free than one needs, the buckets run
    eagerly, each saying why, rather than a child pushing the machine out of memory."""
    import xinserve.engines.platforms.cpu

    monkeypatch.setattr(xinserve.engines.platforms.cpu, "host_available_bytes", lambda: 1 << 20)
    llm = LLM(model, compile="on", kernels=REFERENCE, **OPTIONS)
    assert llm.engine.warmup.done.wait(TIMEOUT_S)
    assert blocking.instances == []
    report = llm.engine.warmup.report()
    assert {b["state"] for b in report["buckets"].values()} == {"failed"} and report["settled"]
    assert all("a compile child needs" in b["error"] for b in report["buckets"].values())
    assert tokens(llm, 3) == tokens(eager, 3)


def test_free_memory_caps_the_compile_children(monkeypatch):
    from xinserve.engines.worker import warmup

    monkeypatch.setattr(warmup.os, "sched_getaffinity", lambda pid: {0, 1})
    spec = type("Spec", (), {"low_priority": False})()
    assert warmup.child_orders(spec, [8, 1, 2, 4], affordable=1) == [(8, 2, 4, 1)]
    model = torch.nn.Linear(256, 256)  # 257 KiB of float32 weights
    assert warmup.child_memory_bytes(model) == 256 * 257 * 4 + warmup.CHILD_OVERHEAD_BYTES
