"""The worker's messages to the HTTP process: sent at once when the socket takes them, else queued to
a thread of their own.

Why: the step loop must never wait for the HTTP process. A ZeroMQ PUSH socket blocks once its
high-water mark is reached (a consumer that stopped reading, an HTTP process starved of CPU). So
``put`` encodes and sends without blocking (``zmq.NOBLOCK``: a few microseconds, no thread hop); when
the socket refuses (``zmq.Again``), the message and every later one go to a queue that a sender thread
drains, in order, and the loop starts its next step at once. The thread hands the socket back once it
has caught up; the socket is used by one thread at a time (``_lock`` guards who owns it).

While the socket refuses a frame, the messages queued behind it are merged: the ``Outputs`` of
consecutive steps become one message (their ``StepOutput``s in step order, the latest stats, every
queue time), and idle ``Stats`` keep only the latest. The HTTP process then catches up with one
message however many steps it missed. When the socket keeps up, nothing is merged: one message per
step, as before.

The heartbeat contract is unchanged: the loop still produces every message, the thread only carries
them, so a stuck loop still goes silent (server/pool/heartbeat.py).
"""

import logging
import queue
import threading
import time

import zmq

from xinserve.server.worker import messages
from xinserve.server.worker.messages import Outputs, Stats

logger = logging.getLogger("xinserve.worker")

_CLOSE = object()  # the queue's end marker
RETRY_MS = 10  # how long a refused frame waits for room before the queue is drained again


def _merged(last: messages.FromWorker, message: messages.FromWorker) -> messages.FromWorker | None:
    """``last`` and ``message`` as one message, or None when they stay two."""
    if isinstance(last, Outputs) and isinstance(message, Outputs):
        return Outputs(last.outputs + message.outputs, message.stats if message.stats is not None else last.stats,
                       {**last.queue_times, **message.queue_times})
    if isinstance(last, Stats) and isinstance(message, Stats):
        return message
    return None


class OutputSender:
    """Every send on ``socket`` goes through ``put`` from construction until ``close`` returns."""

    def __init__(self, socket: zmq.Socket, label: str = "worker") -> None:
        self.socket = socket
        self.label = label
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: list[messages.FromWorker] = []  # taken from the queue, not sent yet
        self._head: bytes | None = None  # _pending[0] encoded, once the socket refused it
        self._lock = threading.Lock()
        self._backlog = False  # the thread owns the socket (messages wait in the queue) until it catches up
        self.merged = 0  # messages folded into another one while the socket was full
        self._thread = threading.Thread(target=self._run, name=f"{label}-sender", daemon=True)
        self._thread.start()

    def put(self, message: messages.FromWorker) -> None:
        """Send ``message`` now if the socket takes it, else queue it for the thread. Raises RuntimeError
        once the thread has stopped, and a socket's error other than ``zmq.Again``, so the worker ends
        and is restarted instead of stepping on in silence."""
        if not self._thread.is_alive():
            raise RuntimeError(f"{self.label}: the output sender has stopped")
        with self._lock:
            if not self._backlog:
                frame = self._encode(message)
                if frame is None:
                    return
                try:
                    self.socket.send(frame, flags=zmq.NOBLOCK, copy=False)
                    return
                except zmq.Again:
                    self._backlog = True
            self._queue.put(message)

    def _encode(self, message: messages.FromWorker) -> bytes | None:
        try:
            return messages.encode(message)
        except (TypeError, ValueError, OverflowError):  # a value msgpack cannot carry: drop this one
            logger.exception("%s: %s not sendable; dropped", self.label, type(message).__name__)
            return None

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (for up to ``timeout_s`` while the socket is full), then stop the thread."""
        self._queue.put(_CLOSE)
        self._thread.join(timeout_s + 1.0)

    def _take(self, block: bool) -> bool:
        """Move queued messages to ``_pending``; False once the end marker came."""
        while True:
            try:
                message = self._queue.get(block=block)
            except queue.Empty:
                return True
            block = False
            if message is _CLOSE:
                return False
            # Only messages behind a refused frame merge (never the encoded head itself).
            behind = self._head is not None and len(self._pending) > 1
            merged = _merged(self._pending[-1], message) if behind else None
            if merged is None:
                self._pending.append(message)
            else:
                self._pending[-1] = merged
                self.merged += 1

    def _send_pending(self) -> bool:
        """Send pending messages in order until the socket refuses one; True when all went."""
        while self._pending:
            if self._head is None:
                self._head = self._encode(self._pending[0])
                if self._head is None:
                    self._pending.pop(0)
                    continue
            try:
                self.socket.send(self._head, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            self._pending.pop(0)
            self._head = None
        return True

    def _run(self) -> None:
        try:
            self._serve()
        except Exception:  # a closed socket or context: the worker is going away
            logger.exception("%s: output sender stopped", self.label)

    def _serve(self) -> None:
        open_ = True
        while open_:
            open_ = self._take(block=not self._pending)
            if not self._send_pending():
                self.socket.poll(RETRY_MS, zmq.POLLOUT)
                continue
            with self._lock:
                if self._queue.empty():  # caught up: ``put`` sends by itself again
                    self._backlog = False
        deadline = time.monotonic() + self._linger_s()
        while not self._send_pending() and time.monotonic() < deadline:
            self.socket.poll(RETRY_MS, zmq.POLLOUT)

    def _linger_s(self) -> float:
        linger_ms = self.socket.getsockopt(zmq.LINGER)
        return 5.0 if linger_ms < 0 else linger_ms / 1000
