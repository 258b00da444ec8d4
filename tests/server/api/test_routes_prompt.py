"""route_encoded: the prompt is tokenised in a thread, and the worker picked only after it."""

import asyncio
import threading
import time

import pytest

from tests.server.pool.routing_fakes import Pool, Worker, any_model, router
from xinserve.server.api.prompt import route_encoded
from xinserve.server.errors import APIError
from xinserve.server.pool.router import Router, Target


async def start(r: Router, encode) -> str:
    """One request: route, then start (which is what raises the worker's load)."""
    _, worker, _ = await route_encoded(r, Target("m", "m"), 1, encode, may_use=any_model)
    worker.load += 1
    return worker.label


def test_encoding_runs_off_the_event_loop():
    threads = []

    def slow_encode(pool: Pool) -> list[int]:
        threads.append(threading.get_ident())
        time.sleep(0.3)
        return [1, 2, 3]

    async def main() -> tuple[int, list[int]]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.ensure_future(ticker())
        _, _, ids = await route_encoded(router(Pool("m", [Worker("a")])), Target("m", "m"), 1, slow_encode,
                                        may_use=any_model)
        task.cancel()
        return ticks, ids

    ticks, ids = asyncio.run(main())
    assert ids == [1, 2, 3]
    assert threads[0] != threading.get_ident()
    assert ticks >= 10  # the loop kept running while the prompt was encoded


def test_worker_is_picked_after_encoding_so_concurrent_requests_spread():
    # "a" is less loaded; the first request to start takes it, so the second must see that.
    a, b = Worker("a", load=0), Worker("b", load=1)
    r = router(Pool("m", [a, b]))

    def encode(pool: Pool) -> list[int]:
        time.sleep(0.05)
        return [1]

    async def main() -> list[str]:
        return list(await asyncio.gather(start(r, encode), start(r, encode)))

    assert sorted(asyncio.run(main())) == ["a", "b"]


def test_looking_up_the_pool_does_not_take_a_round_robin_turn():
    r = router(Pool("m", [Worker("a"), Worker("b")]))

    async def main() -> list[str]:
        labels = []
        for _ in range(4):
            _, worker, _ = await route_encoded(r, Target("m", "m"), 1, lambda pool: [1], may_use=any_model)
            labels.append(worker.label)
        return labels

    assert asyncio.run(main()) == ["a", "b", "a", "b"]


def test_a_pool_going_down_while_encoding_reencodes_for_the_fallback():
    main_worker = Worker("main")
    r = router(Pool("m", [main_worker], fallback=["f"]), Pool("f", [Worker("fb")]))
    seen = []

    def encode(pool: Pool) -> str:
        seen.append(pool.name)
        main_worker.ready = False  # the model's only worker dies while its tokenizer runs
        return f"ids by {pool.name}"

    pool, worker, ids = asyncio.run(route_encoded(r, Target("m", "m"), 1, encode, may_use=any_model))
    assert (pool.name, worker.label, ids) == ("f", "fb", "ids by f")
    assert seen == ["m", "f"]


def test_no_ready_pool_is_a_503_without_encoding():
    worker = Worker("a")
    worker.ready = False

    def encode(pool: Pool) -> list[int]:
        raise AssertionError("encoded for a model with no ready worker")

    with pytest.raises(APIError) as info:
        asyncio.run(route_encoded(router(Pool("m", [worker])), Target("m", "m"), 1, encode, may_use=any_model))
    assert info.value.status == 503
