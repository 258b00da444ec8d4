"""A request's queue hands items over in order, wakes its waiting reader, and keeps what a cancelled
reader did not take."""

import asyncio

import pytest

from xinserve.server.api.stream_queue import ItemQueue


def test_items_come_out_in_order_and_a_waiting_reader_wakes():
    async def go():
        queue = ItemQueue()
        reader = asyncio.ensure_future(queue.get())
        await asyncio.sleep(0)
        assert not reader.done()
        queue.put_nowait(1)
        queue.put_nowait(2)
        assert await reader == 1 and queue.qsize() == 1 and queue.get_nowait() == 2 and queue.empty()
        with pytest.raises(asyncio.QueueEmpty):
            queue.get_nowait()

    asyncio.run(go())


def test_a_cancelled_reader_leaves_the_item_for_the_next():
    async def go():
        queue = ItemQueue()
        reader = asyncio.ensure_future(queue.get())
        await asyncio.sleep(0)
        queue.put_nowait("token")
        reader.cancel()  # before it ran again: the item stays queued
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert await asyncio.wait_for(queue.get(), 1) == "token"

    asyncio.run(go())
