"""The prefill instance's side channel: where a decode instance asks for a finished request's blocks.

A ZeroMQ REP socket on ``kv_ip:kv_port`` answers msgpack requests from a thread of its own, so a reader
is answered while the engine steps (or idles):
- ``{"op": "acquire", "request_id"}`` -> the transfer engine's session, the pool's address and layout,
  and the request's held block ids (``{"ok": False, "error"}`` when it holds none: never held, already
  read, or expired). Acquiring restarts the hold's clock, so blocks being read are never freed under it.
- ``{"op": "release", "request_id"}`` -> the reader is done: the engine frees the blocks at its next
  step or idle tick (``HeldTransfers.finished``).
- ``{"op": "lookup", "room"}`` -> SGLang's bootstrap (server/disagg/bootstrap.py): the ``kv_transfer_params``
  of the request held under that ``bootstrap_room``, ``{"ok": False, "pending": True}`` while no request
  of that room has finished here, or an error when it finished without handing its KV over.
The block manager is the engine thread's alone: this thread only marks requests, the engine frees.
"""

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often the server thread looks at its stop flag


class TransferFailed(RuntimeError):
    """A transfer that could not be made; the consumer recomputes or fails the request."""


@dataclass(slots=True)
class _Held:
    block_ids: list[int]
    deadline: float  # time.monotonic() after which the blocks are freed unread
    room: int | None  # SGLang's bootstrap_room, when its gateway sent one
    params: dict[str, Any]  # what the reader needs (the request's kv_transfer_params answer)


class HeldTransfers:
    """Requests whose blocks wait for their reader, shared by the engine thread and the server thread."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._released: set[str] = set()
        self._rooms: dict[int, str] = {}  # bootstrap_room -> the request held under it
        self._unheld_rooms: dict[int, float] = {}  # rooms whose request handed nothing over -> forget after
        self.sent_total = 0  # holds ended by their reader
        self.expired_total = 0  # holds ended by the timeout

    def hold(self, request_id: str, block_ids: list[int], params: dict[str, Any], room: int | None = None) -> None:
        with self._lock:
            self._held[request_id] = _Held(block_ids, time.monotonic() + self.timeout_s, room, params)
            if room is not None:
                self._rooms[room] = request_id

    def hand_nothing(self, room: int) -> None:
        """The request of ``room`` ended without holding its KV (a stop token first): its reader must not wait."""
        with self._lock:
            self._unheld_rooms[room] = time.monotonic() + self.timeout_s

    def lookup(self, room: int) -> dict[str, Any]:
        """The side channel's answer to a reader that knows only SGLang's ``bootstrap_room``."""
        with self._lock:
            request_id = self._rooms.get(room)
            if request_id is not None and request_id not in self._released:
                return {"ok": True, "kv_transfer_params": self._held[request_id].params}
            if room in self._unheld_rooms:
                return {"ok": False, "error": f"the request of bootstrap_room {room} handed no KV over"}
            return {"ok": False, "pending": True}

    def acquire(self, request_id: str) -> list[int] | None:
        with self._lock:
            held = self._held.get(request_id)
            if held is None or request_id in self._released:
                return None
            held.deadline = time.monotonic() + self.timeout_s
            return held.block_ids

    def release(self, request_id: str) -> bool:
        with self._lock:
            if request_id not in self._held:
                return False
            self._released.add(request_id)
            return True

    def finished(self) -> set[str]:
        """Requests read or expired since the last call; they are forgotten here."""
        now = time.monotonic()
        with self._lock:
            expired = {rid for rid, held in self._held.items() if held.deadline < now and rid not in self._released}
            done = self._released | expired
            for request_id in done:
                room = self._held.pop(request_id).room
                if room is not None:
                    self._rooms.pop(room, None)
            for room in [r for r, deadline in self._unheld_rooms.items() if deadline < now]:
                del self._unheld_rooms[room]
            self.sent_total += len(self._released)
            self.expired_total += len(expired)
            self._released = set()
        if expired:
            logger.warning("freed the KV blocks of %d request(s) no decode instance read within %gs",
                           len(expired), self.timeout_s)
        return done

    @property
    def num_held(self) -> int:
        return len(self._held)


class SideChannelServer:
    """A REP socket bound to ``address`` whose thread answers each request with ``answer(request)``."""

    def __init__(self, address: str, answer: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(address)
        except zmq.ZMQError as exc:
            self._socket.close()
            self._context.term()
            raise RuntimeError(f"the KV side channel cannot listen on {address}: {exc}") from None
        self._answer = answer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-side-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(POLL_MS):
                continue
            try:
                request = msgspec.msgpack.decode(self._socket.recv())
                reply = self._answer(request) if isinstance(request, dict) else {"ok": False, "error": "bad request"}
            except Exception as exc:
                logger.exception("KV side channel: request failed")
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            self._socket.send(msgspec.msgpack.encode(reply))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close()
        self._context.term()


def ask(address: str, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """One request to a side channel; raises ``TransferFailed`` when no answer comes within ``timeout_s``."""
    context = zmq.Context.instance()
    socket = context.socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        try:
            socket.connect(address)
        except zmq.ZMQError as exc:  # a host or port no address can be made of (they come from requests)
            raise TransferFailed(f"the side channel address {address} is not usable: {exc}") from None
        socket.send(msgspec.msgpack.encode(request))
        if not socket.poll(int(timeout_s * 1000)):
            raise TransferFailed(f"the prefill instance's side channel {address} did not answer within {timeout_s:g}s")
        reply = msgspec.msgpack.decode(socket.recv())
    finally:
        socket.close()
    if not isinstance(reply, dict):
        raise TransferFailed(f"the side channel {address} sent a malformed answer")
    return reply
