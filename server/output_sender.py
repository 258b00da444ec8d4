"""The worker's messages to the HTTP process, encoded and sent from a thread of their own.

Why: the step loop must never wait for the HTTP process. A ZeroMQ PUSH socket blocks once its
high-water mark is reached (a consumer that stopped reading, an HTTP process starved of CPU), and
encoding a step's frame is work the next step does not need to wait for. So the loop only queues a
message (``put``, O(1)) and starts the next step at once; this thread encodes and sends, in order.

While the socket refuses a frame (``zmq.Again``), the messages queued behind it are merged: the
``Outputs`` of consecutive steps become one message (their ``StepOutput``s in step order, the latest
stats, every queue time), and idle ``Stats`` keep only the latest. The HTTP process then catches up
with one message however many steps it missed. When the socket takes every frame at once, nothing
is merged: one message per step, as before.

The heartbeat contract is unchanged: the loop still produces every message, this thread only carries
them, so a stuck loop still goes silent (server/heartbeat.py).
"""

import logging
import queue
import threading
import time

import zmq

from server import messages
from server.messages import Outputs, Stats

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
    """Owns ``socket`` from construction on: nothing else may send on it until ``close`` returns."""

    def __init__(self, socket: zmq.Socket, label: str = "worker") -> None:
        self.socket = socket
        self.label = label
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: list[messages.FromWorker] = []  # taken from the queue, not sent yet
        self._head: bytes | None = None  # _pending[0] encoded, once the socket refused it
        self.merged = 0  # messages folded into another one while the socket was full
        self._thread = threading.Thread(target=self._run, name=f"{label}-sender", daemon=True)
        self._thread.start()

    def put(self, message: messages.FromWorker) -> None:
        """Queue ``message``; raises RuntimeError once the thread has stopped (its socket failed), so
        the worker ends and is restarted instead of stepping on in silence."""
        if not self._thread.is_alive():
            raise RuntimeError(f"{self.label}: the output sender has stopped")
        self._queue.put(message)

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
                try:
                    self._head = messages.encode(self._pending[0])
                except (TypeError, ValueError, OverflowError):  # a value msgpack cannot carry: drop this one
                    logger.exception("%s: %s not sendable; dropped", self.label, type(self._pending.pop(0)).__name__)
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
        deadline = time.monotonic() + self._linger_s()
        while not self._send_pending() and time.monotonic() < deadline:
            self.socket.poll(RETRY_MS, zmq.POLLOUT)

    def _linger_s(self) -> float:
        linger_ms = self.socket.getsockopt(zmq.LINGER)
        return 5.0 if linger_ms < 0 else linger_ms / 1000
