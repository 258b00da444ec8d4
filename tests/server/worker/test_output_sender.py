"""The worker never waits for the HTTP process: a socket that takes no frame does not stop the steps.

The loop runs in a thread around the scripted engine of test_worker_loop.py; its output socket is a
double that refuses every frame (as a full ZeroMQ PUSH socket does) until the test opens it. The
steps go on meanwhile, and once it opens, every token arrives in order in fewer messages.
"""

import threading
import time

import pytest
import zmq

from tests.server.worker.test_worker_loop import ScriptedEngine, add
from xinserve.server.worker import messages
from xinserve.server.worker.engine_worker import WorkerLoop
from xinserve.server.worker.messages import Outputs, Shutdown
from xinserve.server.worker.output_sender import OutputSender

TIMEOUT_S = 10


class GatedSocket:
    """A PUSH socket's double: refuses frames (``zmq.Again``, or blocks when sent to without NOBLOCK)
    while ``gate`` is closed; records what it took."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.frames: list[bytes] = []

    def send(self, frame, flags: int = 0, copy: bool = True) -> None:
        if not self.gate.is_set():
            if flags & zmq.NOBLOCK:
                raise zmq.Again()
            self.gate.wait()
        self.frames.append(bytes(frame))

    def poll(self, timeout_ms: int, flags: int = zmq.POLLIN) -> int:
        return zmq.POLLOUT if self.gate.wait(timeout_ms / 1000) else 0

    def getsockopt(self, option: int) -> int:
        return -1

    def messages(self) -> list:
        return [messages.decode_from_worker(f) for f in self.frames]


class CountingEngine(ScriptedEngine):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def step(self):
        self.steps += 1
        return super().step()


def wait_for(pred, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_steps_go_on_while_the_http_process_reads_nothing():
    ctx = zmq.Context()
    to_worker, recv = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    to_worker.bind("inproc://sender-in")
    recv.connect("inproc://sender-in")
    engine, out = CountingEngine(), GatedSocket()
    loop = WorkerLoop(engine, recv, out, "test")
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        to_worker.send(messages.encode(add("a", [1], max_tokens=20)))
        # Not one frame has left, yet the request runs to its end.
        wait_for(lambda: "a" not in engine.requests and engine.steps >= 20, "the steps waited for the consumer")
        assert out.frames == []
        out.gate.set()
        wait_for(lambda: any(isinstance(m, Outputs) and any(o.finished for o in m.outputs) for m in out.messages()),
                 "the queued outputs never arrived")
        steps = [m for m in out.messages() if isinstance(m, Outputs)]
        tokens = [t for m in steps for o in m.outputs for t in o.new_token_ids]
        assert tokens == list(range(101, 121))  # every token once, in step order
        assert len(steps) < 20 and loop.sender.merged > 0  # the backlog went out merged
        assert "a" in steps[0].queue_times
    finally:
        out.gate.set()
        to_worker.send(messages.encode(Shutdown()))
        thread.join(TIMEOUT_S)
        to_worker.close(linger=0)
        recv.close(linger=0)
        ctx.term()
    assert not thread.is_alive()


def test_nothing_merges_while_the_socket_keeps_up():
    out = GatedSocket()
    out.gate.set()
    sender = OutputSender(out, "test")
    for i in range(5):
        sender.put(Outputs([], None, {str(i): 0.0}))
    sender.close()
    assert [list(m.queue_times) for m in out.messages()] == [["0"], ["1"], ["2"], ["3"], ["4"]]
    assert sender.merged == 0


def test_close_sends_what_is_queued():
    out = GatedSocket()
    sender = OutputSender(out, "test")
    sender.put(messages.Failed("x", messages.RequestError("boom")))
    sender.put(Outputs([], None, {"y": 1.0}))
    threading.Timer(0.05, out.gate.set).start()
    sender.close()
    assert [type(m).__name__ for m in out.messages()] == ["Failed", "Outputs"]


def test_a_message_that_cannot_be_encoded_is_dropped_and_the_rest_go():
    out = GatedSocket()
    out.gate.set()
    sender = OutputSender(out, "test")
    sender.put(messages.InfoUpdate({"kernels": object()}))
    sender.put(Outputs([], None, {"z": 1.0}))
    sender.close()
    assert [type(m).__name__ for m in out.messages()] == ["Outputs"]


def test_a_failed_socket_ends_the_loop_instead_of_silence():
    class BrokenSocket(GatedSocket):
        def send(self, frame, flags: int = 0, copy: bool = True) -> None:
            raise zmq.ZMQError(zmq.ETERM)

    sender = OutputSender(BrokenSocket(), "test")
    with pytest.raises(zmq.ZMQError):
        sender.put(Outputs([]))
    sender.close()


def test_the_thread_hands_the_socket_back_once_it_caught_up():
    out = GatedSocket()
    sender = OutputSender(out, "test")
    sender.put(Outputs([], None, {"a": 0.0}))  # refused: queued for the thread
    assert out.frames == [] and sender._backlog
    out.gate.set()
    wait_for(lambda: not sender._backlog, "the thread never caught up")
    sender.put(Outputs([], None, {"b": 0.0}))  # sent by ``put`` itself
    assert [list(m.queue_times) for m in out.messages()] == [["a"], ["b"]]
    sender.close()
