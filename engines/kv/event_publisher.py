"""Publishes each step's KV events over ZeroMQ, the way vLLM's ``ZmqEventPublisher`` does on the wire.

PUB socket: one multipart message per batch — (topic, sequence number as 8 big-endian bytes, msgpack
``EventBatch``); sequence numbers count from 0 per publisher. ROUTER socket (``replay_endpoint``): a
client (REQ) sends the first sequence number it missed (8 big-endian bytes) and receives every
buffered batch from there as (seq, payload) pairs, then (-1, b"") to end. The last ``buffer_steps``
batches are kept. Encoding and sending run on a thread, off the step: the engine only enqueues.
"""

import logging
import queue
import threading
from collections import deque

import msgspec
import zmq

from xinserve.engines.kv.events import EventBatch, KVEventsConfig, offset_endpoint

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
POLL_S = 0.05  # how often the thread looks at the replay socket while no batch arrives


def _binds(endpoint: str) -> bool:
    """vLLM's convention: bind a stable address (wildcard host, ipc, inproc); connect to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.data_parallel_rank = data_parallel_rank
        self.endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, data_parallel_rank)
        self._topic = config.topic.encode()
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context.instance()
        # Sockets are made (and a taken port reported) here, then used by the thread alone.
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None
        try:
            (self._pub.bind if _binds(self.endpoint) else self._pub.connect)(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise RuntimeError(f"kv events: cannot open {self.endpoint} / {self.replay_endpoint}: {exc}") from exc
        self.dropped = 0  # batches not published because the queue was full
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV events on %s (replay: %s)", self.endpoint, self.replay_endpoint)

    def publish(self, batch: EventBatch) -> None:
        """Queue one step's batch; never blocks the step (a full queue drops it and counts the drop)."""
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (within ``timeout_s``), stop the thread, close the sockets."""
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:  # the thread is stuck or gone: leave it (a daemon) and its sockets
            return
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        while True:
            self._serve_replays()
            try:
                batch = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = encoder.encode(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:
                logger.exception("kv events: batch %d not sent (kept for replay)", seq)
            self._buffer.append((seq, payload))
            seq += 1

    def _serve_replays(self) -> None:
        while self._replay is not None and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("kv events: malformed replay request of %d frame(s) ignored", len(frames))
                continue
            client, empty, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart((client, empty, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, empty, END_OF_REPLAY, b""))


def make_publisher(config: dict | None, data_parallel_rank: int) -> ZmqEventPublisher | None:
    """The engine's publisher: None unless the config enables events with the zmq publisher."""
    if config is None:
        return None
    parsed = KVEventsConfig.parse(config)
    return ZmqEventPublisher(parsed, data_parallel_rank) if parsed.publishes else None
