"""The worker's step loop, in a thread over in-process ZeroMQ sockets, around a scripted engine.

The engine here is a small deterministic stand-in (token ids count up; a flag makes one step fail)
so the loop's own contract is pinned: one ``Outputs`` message per step, a bad request answered as
``Failed`` without ending the loop, a failing step failing only the requests in it, and aborts.
"""

import sys
import threading
import time

import pytest
import zmq

from xinserve.engines.core.outputs import EngineStats, RequestFailure, StepOutput, StepResult
from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.server.worker import messages
from xinserve.server.worker.engine_worker import ASYNC_GIL_SWITCH_INTERVAL_S, WorkerLoop
from xinserve.server.worker.messages import (
    Abort,
    Add,
    Failed,
    LoadLora,
    LoraDone,
    Outputs,
    Shutdown,
    Stats,
    UnloadLora,
)


class ScriptedEngine:
    def __init__(self) -> None:
        self.seqs: dict[tuple[str, int], list] = {}  # (id, index) -> [produced, max_tokens]
        self.fail_next_step = False
        self.aborted: list[tuple[str, int | None]] = []
        self.loras: set[str] = set()

    def add_lora(self, name, path) -> None:
        if path == "/crash":
            raise RuntimeError("out of host memory")
        if "rank" in path:
            raise ValueError(f"LoRA adapter {path!r}: rank 64 is more than max_lora_rank 16")
        self.loras.add(name)

    def remove_lora(self, name) -> None:
        self.loras.remove(name)  # KeyError when not loaded, as the engine's

    def lora_names(self) -> list[str]:
        return sorted(self.loras)

    def add_request(self, request_id, prompt_token_ids, params) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        for i in range(params.n):
            self.seqs[request_id, i] = [0, params.max_tokens]

    def abort_request(self, request_id, index=None, emitted=None) -> None:
        self.aborted.append((request_id, index))
        for key in [k for k in self.seqs if k[0] == request_id and index in (None, k[1])]:
            del self.seqs[key]

    def has_unfinished_requests(self) -> bool:
        return bool(self.seqs)

    @property
    def requests(self) -> set[str]:
        return {rid for rid, _ in self.seqs}

    def step(self) -> StepResult:
        time.sleep(0.001)  # a step takes time; without it a long request floods the socket at once
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("device fell over")
        outs = []
        for (rid, i), state in list(self.seqs.items()):
            state[0] += 1
            done = state[0] >= state[1]
            outs.append(StepOutput(rid, i, [100 + state[0]], done, "length" if done else None))
            if done:
                del self.seqs[rid, i]
        return StepResult(outs)

    def stats(self) -> EngineStats:
        return EngineStats(len(self.seqs), 0, 0.0, 0, 0, 0, 0, 0)


@pytest.fixture
def loop_io():
    ctx = zmq.Context()
    to_worker = ctx.socket(zmq.PUSH)
    to_worker.bind("inproc://in")
    from_worker = ctx.socket(zmq.PULL)
    from_worker.bind("inproc://out")
    recv, send = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    recv.connect("inproc://in")
    send.connect("inproc://out")
    engine = ScriptedEngine()
    loop = WorkerLoop(engine, recv, send, "test")
    # Started by the first ``until``: messages posted before it are all queued when the loop wakes.
    thread = threading.Thread(target=loop.run, daemon=True)

    def post(message) -> None:
        to_worker.send(message if isinstance(message, bytes) else messages.encode(message))

    def until(pred, limit: int = 5000) -> list:
        """Collect messages until ``pred(message)``; ``Stats`` heartbeats included."""
        if not thread.is_alive():
            thread.start()
        got = []
        for _ in range(limit):
            assert from_worker.poll(5000), f"no message; got {got}"
            msg = messages.decode_from_worker(from_worker.recv())
            got.append(msg)
            if pred(msg):
                return got
        raise AssertionError(f"predicate never held; last messages: {got[-3:]}")

    yield engine, post, until, thread
    post(Shutdown())
    if thread.is_alive():
        thread.join(5)
    for s in (to_worker, from_worker, recv, send):
        s.close(linger=0)
    ctx.term()


def add(request_id: str, prompt_token_ids: list[int], n: int = 1, max_tokens: int = 3) -> Add:
    return messages.add_request(request_id, prompt_token_ids, SamplingParams(n=n, max_tokens=max_tokens, temperature=0))


def outputs(got: list) -> list[StepOutput]:
    return [o for m in got if isinstance(m, Outputs) for o in m.outputs]


def finished(rid: str, index: int = 0):
    return lambda m: isinstance(m, Outputs) and any(
        o.request_id == rid and o.index == index and o.finished for o in m.outputs)


def failed(m) -> bool:
    return isinstance(m, Failed)


def test_tokens_flow_one_message_per_step(loop_io):
    _, post, until, _ = loop_io
    post(add("a", [1, 2], max_tokens=3))
    post(add("b", [1], max_tokens=2))
    got = until(finished("a"))
    outs = outputs(got)
    assert [o.new_token_ids[0] for o in outs if o.request_id == "a"] == [101, 102, 103]
    assert [o.finish_reason for o in outs if o.request_id == "b"] == [None, "length"]
    steps = [m for m in got if isinstance(m, Outputs)]
    assert len(steps) == 3  # both requests share the messages of the steps they ran in
    first = next(m for m in steps if any(o.request_id == "a" for o in m.outputs))
    assert "a" in first.queue_times  # queue time reported with a request's first output
    assert steps[-1].stats is not None  # stats ride along once the engine goes idle


def test_bad_request_is_an_error_and_the_loop_lives_on(loop_io):
    _, post, until, thread = loop_io
    post(add("bad", []))
    err = until(failed)[-1]
    assert (err.request_id, err.error.status) == ("bad", 400) and "empty" in err.error.message
    bad = add("bad-params", [1])
    bad.params.n = "two"  # of the wrong type: what a client of the wire format could send
    post(bad)
    err = until(failed)[-1]
    assert (err.request_id, err.error.status) == ("bad-params", 400)
    post(messages.encode(["nonsense", 1, 2]))
    post(add("good", [1], max_tokens=1))
    until(finished("good"))
    assert thread.is_alive()


def test_failed_step_fails_its_requests_only(loop_io):
    engine, post, until, thread = loop_io
    engine.fail_next_step = True
    post(add("x", [1], max_tokens=50))
    err = until(failed)[-1]
    assert (err.request_id, err.error.status) == ("x", 500)
    assert ("x", None) in engine.aborted
    post(add("y", [1], max_tokens=2))
    until(finished("y"))
    assert thread.is_alive()


def test_abort_whole_request_and_single_choice(loop_io):
    engine, post, until, _ = loop_io
    post(add("r", [1], n=2, max_tokens=1000))
    until(lambda m: isinstance(m, Outputs))
    post(Abort([("r", 1)]))
    post(add("marker", [1], max_tokens=1))
    until(finished("marker"))
    assert ("r", 1) in engine.aborted and ("r", 0) in engine.seqs
    post(Abort([("r", None), ("unknown", None)]))
    # After the abort the engine is idle: the next message is a ``Stats`` with nothing running.
    stats = until(lambda m: isinstance(m, Stats))[-1]
    assert stats.stats.num_running == 0
    assert not engine.seqs


def test_shutdown_ends_the_loop(loop_io):
    _, post, until, thread = loop_io
    post(add("a", [1], max_tokens=1))
    until(finished("a"))
    post(Shutdown())
    thread.join(5)
    assert not thread.is_alive()


def test_a_schema_that_failed_to_compile_is_a_400_not_a_500(loop_io):
    engine, post, until, thread = loop_io
    scripted = engine.step

    def step_once_failing_the_schema() -> StepResult:
        engine.step = scripted
        for key in [k for k in engine.seqs if k[0] == "s"]:
            del engine.seqs[key]
        return StepResult([], [RequestFailure("s", "the JSON schema took more than 10s to compile", bad_request=True)])

    engine.step = step_once_failing_the_schema
    post(add("s", [1], max_tokens=50))
    err = until(failed)[-1]
    assert (err.request_id, err.error.status, err.error.message) == (
        "s", 400, "the JSON schema took more than 10s to compile")
    post(add("next", [1], max_tokens=1))
    until(finished("next"))
    assert thread.is_alive()


class SteppingAhead:
    """An engine's async stepper (engines/core/async_scheduling.py) that records the GIL switch interval."""

    def __init__(self, engine: ScriptedEngine) -> None:
        self.engine = engine
        self.intervals: list[float] = []

    def step(self) -> StepResult:
        self.intervals.append(sys.getswitchinterval())
        return self.engine.step()

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()

    def close(self) -> None:
        pass


def test_async_loop_shortens_the_gil_switch_interval_while_it_runs():
    """The step thread must not wait out 5 ms of the loop thread's Python for the GIL; the process's
    own interval comes back when the loop ends."""
    stepper = SteppingAhead(ScriptedEngine())
    stepper.engine.async_steps = lambda: stepper
    ctx = zmq.Context()
    to_worker, recv, send, sink = (ctx.socket(k) for k in (zmq.PUSH, zmq.PULL, zmq.PUSH, zmq.PULL))
    to_worker.bind("inproc://gil-in")
    sink.bind("inproc://gil-out")
    recv.connect("inproc://gil-in")
    send.connect("inproc://gil-out")
    before = sys.getswitchinterval()
    loop = WorkerLoop(stepper.engine, recv, send, "test")
    to_worker.send(messages.encode(add("a", [1, 2], max_tokens=3)))
    thread = threading.Thread(target=loop.run)
    thread.start()
    assert sink.poll(5000), "no output from the loop"
    deadline = time.monotonic() + 5
    while stepper.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    to_worker.send(messages.encode(Shutdown()))
    thread.join(5)
    for s in (to_worker, recv, send, sink):
        s.close(linger=0)
    ctx.term()
    assert stepper.intervals and set(stepper.intervals) == {min(before, ASYNC_GIL_SWITCH_INTERVAL_S)}
    assert sys.getswitchinterval() == before


def test_lora_updates_are_answered_in_order_and_the_loop_lives_on(loop_io):
    _, post, until, thread = loop_io
    for message in (LoadLora(1, "sql", "/sql"), LoadLora(2, "big", "/rank-64"), LoadLora(3, "x", "/crash"),
                    UnloadLora(4, "sql"), UnloadLora(5, "sql")):
        post(message)
    got = [m for m in until(lambda m: isinstance(m, LoraDone) and m.op == 5) if isinstance(m, LoraDone)]
    assert [(m.op, m.adapters) for m in got] == [(1, ["sql"]), (2, ["sql"]), (3, ["sql"]), (4, []), (5, [])]
    assert [m.error for m in got if m.op in (1, 4, 5)] == [None, None, None]  # unloading twice: gone is gone
    refused, crashed = got[1].error, got[2].error
    assert refused.status == 400 and "rank 64 is more than max_lora_rank 16" in refused.message
    assert crashed.status == 500 and "RuntimeError: out of host memory" in crashed.message
    post(add("after", [1], max_tokens=1))
    until(finished("after"))
    assert thread.is_alive()
