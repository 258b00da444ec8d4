"""The drain: requests counted until their last byte, new ones refused, the rest ended after the wait."""

import asyncio
from collections.abc import Awaitable, Callable

import httpx
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from xinserve.server.http.drain import Drain, DrainMiddleware


class Worker:
    def __init__(self) -> None:
        self.ended: list[str] = []

    def end_requests(self, message: str) -> None:
        self.ended.append(message)


class Pool:
    def __init__(self) -> None:
        self.workers = [Worker(), Worker()]


def ended(pool: Pool) -> list[int]:
    return [len(w.ended) for w in pool.workers]


def test_nothing_in_flight_ends_nothing():
    pool = Pool()
    drain = Drain([pool])
    asyncio.run(drain.run(timeout_s=60))
    assert drain.draining and ended(pool) == [0, 0]


def drain_one_request(timeout_s: float, meanwhile: Callable[[Drain, Pool, asyncio.Future], Awaitable[None]]) -> list[int]:
    """Drain a pool with one request in flight: ``meanwhile(drain, pool, running drain)`` runs while
    the drain waits, then the request ends; how many requests each worker was told to end."""
    pool = Pool()
    drain = Drain([pool])

    async def go():
        drain.enter()
        running = asyncio.ensure_future(drain.run(timeout_s=timeout_s))
        await meanwhile(drain, pool, running)
        drain.leave()
        await running

    asyncio.run(go())
    return ended(pool)


async def until_ended(pool: Pool) -> None:
    while ended(pool) == [0, 0]:
        await asyncio.sleep(0)


def test_requests_that_finish_in_time_are_not_ended():
    async def meanwhile(drain, pool, running):
        await asyncio.sleep(0)
        assert drain.draining and not running.done()

    assert drain_one_request(60, meanwhile) == [0, 0]


def test_requests_past_the_timeout_are_ended_then_awaited():
    async def meanwhile(drain, pool, running):
        await until_ended(pool)
        assert not running.done()  # the ended request's handler still writes its error frame

    assert drain_one_request(0, meanwhile) == [1, 1]


def test_a_second_signal_ends_requests_at_once():
    async def meanwhile(drain, pool, running):
        await asyncio.sleep(0)
        drain.hurry()
        await until_ended(pool)

    assert drain_one_request(3600, meanwhile) == [1, 1]


def test_middleware_counts_requests_and_refuses_new_ones_while_draining():
    drain = Drain([])
    seen: list[int] = []

    async def work(request):
        seen.append(drain.in_flight)
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/v1/x", work, methods=["POST"]), Route("/health", work)])
    app.add_middleware(DrainMiddleware, drain=drain)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            before = await client.post("/v1/x")
            drain.draining = True
            refused = await client.post("/v1/x")
            probe = await client.get("/health")
        return before, refused, probe

    before, refused, probe = asyncio.run(go())
    assert before.status_code == 200 and seen == [1, 0]  # counted while running; probes are not
    assert drain.in_flight == 0
    assert refused.status_code == 503 and refused.headers["connection"] == "close"
    assert refused.json()["error"]["code"] == "shutting_down"
    assert refused.json()["error"]["type"] == "service_unavailable_error"
    assert probe.status_code == 200
