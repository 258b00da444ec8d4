"""``ItemQueue``: a request's outputs on their way from ``Fanout.deliver`` to the stream that reads them.

One task reads a request's queue, and the HTTP process puts one item per token per stream. An
``asyncio.Queue`` spends ~10 Python calls on each put and get (its size limit, a deque of getters,
the unfinished-task count and its ``Event``); this one is a deque and at most one waiting future
(tests/server/api/test_stream_path_calls.py counts the calls per token). It keeps ``asyncio.Queue``'s names for
what the streams and tests use: ``put_nowait``, ``get``, ``get_nowait``, ``empty``, ``qsize``.

``push``, when set, is offered each item that arrives while the reader waits on an empty queue; if it
takes the item (True), the reader is not woken: the step's callback wrote that token's frame itself
(server/api/stream_push.py), so a stream's task sleeps through its ordinary tokens. ``hold``, when set,
is a write that item began and the server paused: the reader waits for it before it takes an item,
so the frames still go out in order (and a failed write raises in the reader).
"""

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any


class ItemQueue:
    """Unbounded, first in first out, for one reader at a time."""

    __slots__ = ("_items", "_waiter", "hold", "push")

    def __init__(self) -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None  # the reader's, while it waits for an item
        self.push: Callable[[Any], bool] | None = None
        self.hold: asyncio.Future | None = None

    def put_nowait(self, item: Any) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            self._items.append(item)
            return
        if self.push is not None and not self._items and self.push(item):
            return
        self._items.append(item)
        waiter.set_result(None)

    def wake(self) -> None:
        """Wake a waiting reader without an item (it looks at ``hold`` again)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Any:
        while True:
            if self.hold is not None:
                try:
                    await self.hold
                finally:
                    self.hold = None
            if self._items:
                return self._items.popleft()
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:  # a cancelled reader leaves the items where they are
                self._waiter = None

    def get_nowait(self) -> Any:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)
