"""``ItemQueue``: a request's outputs on their way from ``Fanout.deliver`` to the stream that reads them.

One task reads a request's queue, and the HTTP process puts one item per token per stream. An
``asyncio.Queue`` spends ~10 Python calls on each put and get (its size limit, a deque of getters,
the unfinished-task count and its ``Event``); this one is a deque and at most one waiting future
(benchmarks/stream_path_cpu.py counts the calls per token). It keeps ``asyncio.Queue``'s names for
what the streams and tests use: ``put_nowait``, ``get``, ``get_nowait``, ``empty``, ``qsize``.
"""

import asyncio
from collections import deque
from typing import Any


class ItemQueue:
    """Unbounded, first in first out, for one reader at a time."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None  # the reader's, while it waits for an item

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Any:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:  # a cancelled reader leaves the items where they are
                self._waiter = None
        return self._items.popleft()

    def get_nowait(self) -> Any:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)
