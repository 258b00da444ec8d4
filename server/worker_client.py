"""The HTTP process's handle on one engine worker process.

It spawns the worker, keeps its state (starting -> ready, or failed / dead / stopped), its latest
engine stats and its load (sequences in flight), and fans the worker's per-step OUTPUTS messages
out to one asyncio queue per request. Sending never awaits: aborts are issued from ``finally``
blocks of cancelled tasks, where an await would be cancelled again.
"""

import asyncio
import logging
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from server import ipc
from server.worker import WorkerSpec, run_worker

logger = logging.getLogger("xinserve.server")

STARTING, READY, FAILED, DEAD, STOPPED = "starting", "ready", "failed", "dead", "stopped"

_context: zmq.Context | None = None


def _zmq_context() -> zmq.Context:
    """One ZeroMQ context per process, shared by every client."""
    global _context
    if _context is None:
        _context = zmq.Context()
    return _context


@dataclass(slots=True)
class WorkerError:
    """A request failed inside the worker (or the worker died under it)."""

    status: int
    message: str


@dataclass(slots=True)
class RequestStream:
    """Items of one request as they arrive: ``ipc.TokenOutput`` or ``WorkerError``."""

    request_id: str
    n: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: set[int] = field(default_factory=set)  # choice indices finished or aborted
    queue_time: float | None = None

    @property
    def unfinished(self) -> int:
        return self.n - len(self.done)


class WorkerClient:
    def __init__(self, spec: WorkerSpec, max_num_seqs: int, max_waiting_requests: int) -> None:
        self.spec = spec
        self.capacity = max_num_seqs + max_waiting_requests
        self.state = STARTING
        self.last_error: str | None = None
        self.info: dict[str, Any] = {}
        self.stats: dict[str, float] = {}
        self.load = 0  # sequences submitted and not finished
        self.last_message_at: float | None = None
        self.started_at = time.time()
        self._streams: dict[str, RequestStream] = {}
        self._send: zmq.Socket | None = None
        self._recv: zmq.Socket | None = None
        self._proc: mp.process.BaseProcess | None = None

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def model_name(self) -> str:
        return self.spec.model_name

    @property
    def ready(self) -> bool:
        return self.state == READY

    def has_capacity(self, n: int) -> bool:
        return self.load + n <= self.capacity

    def listen(self) -> None:
        """Bind the output socket and read it from the event loop.

        A plain socket whose file descriptor the loop watches, drained in one callback, rather than
        zmq.asyncio: one callback per wake-up instead of a future per message, measured at half
        the receive cost for one-request steps (benchmarks/ipc_overhead.py).
        """
        self._recv = _zmq_context().socket(zmq.PULL)
        self._recv.setsockopt(zmq.RCVHWM, 0)
        self._recv.bind(self.spec.output_addr)
        asyncio.get_running_loop().add_reader(self._recv.getsockopt(zmq.FD), self._on_readable)

    def start(self) -> None:
        """Bind the sockets and spawn the worker (never fork: NPUs and CUDA cannot survive it)."""
        self.listen()
        # Sending never blocks either: no high-water mark, NOBLOCK, on a plain socket.
        self._send = _zmq_context().socket(zmq.PUSH)
        self._send.setsockopt(zmq.SNDHWM, 0)
        self._send.setsockopt(zmq.LINGER, 0)
        self._send.bind(self.spec.input_addr)
        self._proc = mp.get_context("spawn").Process(
            target=run_worker, args=(self.spec,), name=f"xinserve-{self.model_name}-{self.label}", daemon=True
        )
        self._proc.start()
        logger.info("spawned worker %s/%s (pid %s) on %s", self.model_name, self.label, self._proc.pid,
                    self.spec.device)
        asyncio.get_running_loop().add_reader(self._proc.sentinel, self._on_exit)

    def add(self, request_id: str, prompt_token_ids: list[int], params: dict[str, Any]) -> RequestStream:
        stream = RequestStream(request_id, int(params.get("n", 1)))
        self._streams[request_id] = stream
        self.load += stream.n
        if not self._post([ipc.ADD, request_id, prompt_token_ids, params]):
            self._fail(request_id, WorkerError(503, f"worker {self.label} is not accepting requests"))
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; unknown or finished ids are ignored."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self.load -= stream.unfinished
        self._post([ipc.ABORT, [[request_id, None]]])

    def abort_choice(self, request_id: str, index: int) -> None:
        """Stop one choice of an n > 1 request (its stop string matched) and free its blocks."""
        stream = self._streams.get(request_id)
        if stream is None or index in stream.done:
            return
        stream.done.add(index)
        self.load -= 1
        if stream.unfinished <= 0:
            del self._streams[request_id]
        self._post([ipc.ABORT, [[request_id, index]]])

    def _post(self, message: list[Any]) -> bool:
        if self._send is None or self.state != READY:
            return False
        try:
            self._send.send(ipc.pack(message), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.error("worker %s/%s: send failed: %s", self.model_name, self.label, exc)
            return False
        return True

    def _fail(self, request_id: str, error: WorkerError) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self.load -= stream.unfinished
            stream.queue.put_nowait(error)

    def _on_readable(self) -> None:
        # ZeroMQ's descriptor is edge-triggered: read until EAGAIN or the next edge never comes.
        sock = self._recv
        if sock is None:
            return
        while True:
            try:
                frame = sock.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._dispatch(ipc.unpack(frame.buffer))
            except Exception:
                logger.exception("worker %s/%s: bad message ignored", self.model_name, self.label)

    def _dispatch(self, message: list[Any]) -> None:
        self.last_message_at = time.time()
        kind = message[0]
        if kind == ipc.OUTPUTS:
            self._on_outputs(message[1], message[3])
            if message[2] is not None:
                self.stats = ipc.decode_stats(message[2])
        elif kind == ipc.STATS:
            self.stats = ipc.decode_stats(message[1])
        elif kind == ipc.ERROR:
            self._fail(message[1], WorkerError(int(message[2]), message[3]))
        elif kind == ipc.READY:
            self.info = message[1]
            self.state = READY
            logger.info("worker %s/%s ready in %.1fs (max_model_len=%s)", self.model_name, self.label,
                        time.time() - self.started_at, self.info.get("max_model_len"))
        elif kind == ipc.FAILED:
            self.state = FAILED
            self.last_error = message[1]
            logger.error("worker %s/%s failed to load: %s", self.model_name, self.label, message[1])

    def _on_outputs(self, outputs: list[list[Any]], queue_times: dict[str, float]) -> None:
        streams = self._streams
        for item in outputs:
            out = ipc.decode_output(item)
            stream = streams.get(out.request_id)
            if stream is None:  # aborted here while the worker was still stepping it
                continue
            if stream.queue_time is None and out.request_id in queue_times:
                stream.queue_time = queue_times[out.request_id]
            if out.index in stream.done:  # this choice was aborted here
                continue
            stream.queue.put_nowait(out)
            if out.finished:
                stream.done.add(out.index)
                self.load -= 1
                if stream.unfinished <= 0:
                    del streams[out.request_id]

    def _on_exit(self) -> None:
        assert self._proc is not None
        asyncio.get_running_loop().remove_reader(self._proc.sentinel)
        if self.state not in (FAILED, STOPPED):
            self.state = DEAD
            self.last_error = "worker process exited"
            asyncio.ensure_future(self._report_exit_code())
        for request_id in list(self._streams):
            self._fail(request_id, WorkerError(503, f"worker {self.label} of {self.model_name} died"))

    async def _report_exit_code(self) -> None:
        # The sentinel can fire a moment before the child is reapable; wait off the event loop.
        assert self._proc is not None
        await asyncio.to_thread(self._proc.join, 5)
        code = self._proc.exitcode
        self.last_error = f"worker process exited with code {code}"
        logger.error("worker %s/%s died (exit code %s)", self.model_name, self.label, code)

    def describe(self) -> dict[str, Any]:
        """Per-worker detail for /health."""
        age = None if self.last_message_at is None else round(time.time() - self.last_message_at, 3)
        return {
            "model": self.model_name,
            "worker": self.label,
            "device": self.spec.device,
            "state": self.state,
            "pid": self._proc.pid if self._proc else None,
            "load": self.load,
            "last_error": self.last_error,
            "seconds_since_last_message": age,
            "num_requests_running": self.stats.get("num_running"),
            "num_requests_waiting": self.stats.get("num_waiting"),
            "kv_cache_usage": self.stats.get("kv_cache_usage"),
            "info": self.info,
        }

    async def close(self, timeout_s: float = 10.0) -> None:
        """Ask the worker to stop, wait, then terminate it; release the sockets."""
        proc = self._proc
        if proc is not None and proc.is_alive():
            was_ready = self.state == READY
            self.state = STOPPED
            if was_ready and self._send is not None:
                try:
                    self._send.send(ipc.pack([ipc.SHUTDOWN]), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            deadline = time.monotonic() + (timeout_s if was_ready else 0)
            while proc.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if proc.is_alive():
                proc.terminate()
                await asyncio.to_thread(proc.join, 5)
            if proc.is_alive():
                proc.kill()
        self.state = STOPPED
        if proc is not None:
            asyncio.get_running_loop().remove_reader(proc.sentinel)
        for request_id in list(self._streams):
            self._fail(request_id, WorkerError(503, "the server is shutting down"))
        if self._recv is not None:
            asyncio.get_running_loop().remove_reader(self._recv.getsockopt(zmq.FD))
        for sock in (self._send, self._recv):
            if sock is not None:
                sock.close(linger=0)
