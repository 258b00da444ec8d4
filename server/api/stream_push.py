"""``StreamPush``: a stream's ordinary tokens written from the worker's step callback, not its task.

One worker step reaches the HTTP process as one ``Outputs`` message, read in one callback
(``WorkerClient._on_readable`` -> ``Fanout.deliver``). Without this, each stream's task then wakes
and climbs its chain of async generators (queue -> generation -> group -> view -> SSE events ->
response) to write one frame: a task wake-up per stream per step and ~20 Python calls per token of
plumbing alone (tests/server/api/test_stream_path_calls.py counts them). With it, the deliver callback writes the frame of
each stream's new token itself, so one wake-up serves every stream of the step.

It takes over only what cannot end the stream: an unfinished ``StepOutput`` of a request with one
prompt, one choice and no stop strings, offered while the stream's task waits on an empty queue
(so every earlier frame is written). Everything else (the last token, errors, the deadline, the
usage chunk, ``[DONE]``) wakes the task, which goes on exactly as before. The frame bytes come from
the view's own ``push`` (chat's: ``_ChatView.push``), the same bytes its stream would yield.

The ASGI ``send`` is a coroutine that completes without suspending unless the server paused writing
(flow control: a slow client). It is run to its first suspension here; if it suspends, the rest runs
on the loop, pushing stops, and the stream's task waits for that write before its next one.
"""

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from xinserve.engines.core.outputs import StepOutput
from xinserve.server.api.generation import Delta, Generation
from xinserve.server.api.stream_queue import ItemQueue

# A view's frames for one batch of deltas, encoded: what its stream would yield for them, joined.
PushFrames = Callable[[list[Delta]], bytes]


class StreamPush:
    def __init__(self, gen: Generation, frames: PushFrames) -> None:
        self._gen = gen
        self._frames = frames
        self._send: Callable[[dict], Coroutine] | None = None
        self._queue: ItemQueue | None = None

    @classmethod
    def for_gens(cls, gens: list[Generation], frames: PushFrames) -> "StreamPush | None":
        """A push for a request it can serve (one prompt, one choice, no stop strings), else None."""
        if len(gens) != 1 or len(gens[0].choices) != 1 or gens[0].params.stop:
            return None
        return cls(gens[0], frames)

    def attach(self, send: Callable[[dict], Coroutine]) -> None:
        """Start pushing, through ``send`` (the ASGI send of the body messages), once the response started."""
        queue = self._gen.queue
        if queue is not None:
            self._send, self._queue = send, queue
            queue.push = self._offer

    def detach(self) -> None:
        """Stop pushing (the response ended): the queue forgets this push, which breaks the cycle queue ->
        push -> generation -> queue, so the request's objects are freed at once, not by the cyclic GC."""
        if self._queue is not None and self._queue.push == self._offer:
            self._queue.push = None
        self._send = self._queue = None

    def _offer(self, item: Any) -> bool:
        if type(item) is not StepOutput or item.finished or item.prompt_logprobs is not None:
            return False
        try:
            data = self._frames(self._gen.take([item]))
            if data:
                self._write(data)
        except Exception as exc:  # noqa: BLE001  raised in the stream's task instead, as if it had taken the item
            self._hand_back(_failed(exc))
        return True

    def _write(self, data: bytes) -> None:
        assert self._send is not None
        sending = self._send({"type": "http.response.body", "body": data, "more_body": True})
        try:
            blocker = sending.send(None)
        except StopIteration:
            return
        self._hand_back(_finish(sending, blocker))

    def _hand_back(self, hold: asyncio.Future) -> None:
        """Stop pushing; the stream's task waits for ``hold`` (the write in flight) before its next item."""
        queue = self._queue
        assert queue is not None
        queue.push = None
        queue.hold = hold
        hold.add_done_callback(lambda _: queue.wake())


def _failed(exc: BaseException) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_exception(exc)
    return future


def _finish(coro: Coroutine, blocker: Any) -> asyncio.Future:
    """Run the rest of ``coro``, suspended on ``blocker`` (a future, or None: a bare yield), as a task
    would; a future of its end."""
    loop = asyncio.get_running_loop()
    end = loop.create_future()

    def resume(_: Any = None) -> None:
        try:
            blocker = coro.send(None)
        except StopIteration:
            if not end.done():
                end.set_result(None)
        except BaseException as exc:  # noqa: BLE001  the awaiting task gets it, as from a task
            if not end.done():
                end.set_exception(exc)
        else:
            wait(blocker)

    def wait(blocker: Any) -> None:
        if blocker is None:
            loop.call_soon(resume)
        else:
            blocker.add_done_callback(resume)

    wait(blocker)
    return end
