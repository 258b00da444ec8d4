"""Routing a worker's step outputs to the streams of the requests in flight on it.

The HTTP process owns each request's state: how many choices it has and which are done (finished,
stopped by a stop string, or aborted), and so the worker's load. The worker forgets a request as
soon as its engine does. Nothing here awaits: aborts are issued from ``finally`` blocks of
cancelled tasks, where an await would be cancelled again.

The worker knows a request by a short handle (``"0"``, ``"1f"``, ...: a per-worker counter in hex),
never by its HTTP request id: the id would be most of each token's bytes on the wire (42 of 53 in a
one-token ``StepOutput``). Handles are what ``Add``, ``Abort``, ``StepOutput`` and ``Failed`` carry.
"""

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from xinserve.server.api.stream_queue import ItemQueue
from xinserve.server.worker.messages import Abort, RequestError, ToWorker


@dataclass(slots=True)
class RequestStream:
    """Items of one request as they arrive: ``StepOutput`` or ``RequestError`` (the last one)."""

    request_id: str
    n: int
    handle: str = ""  # the worker's name for it
    queue: ItemQueue = field(default_factory=ItemQueue)
    done: set[int] = field(default_factory=set)  # choice indices finished or aborted
    queue_time: float | None = None

    @property
    def unfinished(self) -> int:
        return self.n - len(self.done)


class Fanout:
    """The requests in flight on one worker. ``post`` sends a message to the worker and says
    whether it went (False: the worker is not accepting messages)."""

    def __init__(self, post: Callable[[ToWorker], bool]) -> None:
        self._post = post
        self._streams: dict[str, RequestStream] = {}
        self._handles: dict[str, RequestStream] = {}  # the same streams by their worker-side handle
        self._counter = itertools.count()
        self.load = 0  # sequences submitted and not finished

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def new_handle(self) -> str:
        return format(next(self._counter), "x")

    def open(self, request_id: str, n: int, handle: str | None = None) -> RequestStream:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        handle = self.new_handle() if handle is None else handle
        stream = self._streams[request_id] = self._handles[handle] = RequestStream(request_id, n, handle)
        self.load += n
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; unknown or finished ids are ignored."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            del self._handles[stream.handle]
            self.load -= stream.unfinished
            self._post(Abort([(stream.handle, None)]))

    def abort_choice(self, request_id: str, index: int, emitted: int | None = None) -> None:
        """Stop one choice of a request (its stop string matched, after ``emitted`` output tokens) and free
        its blocks; the request goes on while other choices do."""
        stream = self._streams.get(request_id)
        if stream is None or index in stream.done:
            return
        self._finish_choice(stream, index)
        self._post(Abort([(stream.handle, index)], [emitted]))

    def fail(self, request_id: str, error: RequestError) -> None:
        """End a request with ``error``: its last item."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            del self._handles[stream.handle]
            self.load -= stream.unfinished
            stream.queue.put_nowait(error)

    def fail_handle(self, handle: str, error: RequestError) -> None:
        """``fail`` for the worker's verdict on the request it knows as ``handle``."""
        stream = self._handles.get(handle)
        if stream is not None:
            self.fail(stream.request_id, error)

    def fail_all(self, error: RequestError, abort: bool = False) -> int:
        """End every request in flight with ``error`` (and abort them in the worker); how many."""
        ended = list(self._streams.values())
        for stream in ended:
            self.fail(stream.request_id, error)
        if abort and ended:  # should the worker still run them, it drops them rather than run them for nobody
            self._post(Abort([(stream.handle, None) for stream in ended]))
        return len(ended)

    def deliver(self, outputs: list, queue_times: dict[str, float]) -> None:
        """Hand one step's ``StepOutput``s to their streams (``request_id``: the handle)."""
        streams = self._handles
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:  # aborted here while the worker was still stepping it
                continue
            if stream.queue_time is None and out.request_id in queue_times:
                stream.queue_time = queue_times[out.request_id]
            if out.index in stream.done:  # this choice was aborted here
                continue
            stream.queue.put_nowait(out)
            if out.finished:
                self._finish_choice(stream, out.index)

    def _finish_choice(self, stream: RequestStream, index: int) -> None:
        stream.done.add(index)
        self.load -= 1
        if stream.unfinished <= 0:
            del self._streams[stream.request_id]
            del self._handles[stream.handle]
