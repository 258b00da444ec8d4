"""Routing: least-loaded ready worker, ties taken in turn, 429 when full, 503 and the fallback chain;
a replacement worker for a retried request."""

import asyncio

import pytest

from tests.server.pool.routing_fakes import Pool, Worker, router
from xinserve.server.errors import APIError
from xinserve.server.pool.model_pool import worker_labels


def test_least_loaded_ready_worker_wins():
    a, b, c = Worker("a", load=3), Worker("b", load=1), Worker("c", ready=False, load=0)
    pool, worker = router(Pool("m", [a, b, c])).route("m")
    assert (pool.name, worker.label) == ("m", "b")


def test_ties_are_taken_in_turn():
    workers = [Worker("a"), Worker("b"), Worker("c")]
    r = router(Pool("m", workers))
    assert [r.route("m")[1].label for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_full_workers_give_429_not_fallback():
    r = router(Pool("m", [Worker("a", load=4), Worker("b", load=3)], fallback=["f"]), Pool("f", [Worker("x")]))
    assert r.route("m", n=1)[1].label == "b"
    with pytest.raises(APIError) as info:
        r.route("m", n=2)
    assert info.value.status == 429 and info.value.type == "rate_limit_error"


def test_n_beyond_any_worker_is_400_not_429():
    r = router(Pool("m", [Worker("a", capacity=4), Worker("b", capacity=6)]))
    assert r.route("m", n=6)[1].label == "b"
    with pytest.raises(APIError) as info:
        r.route("m", n=7)
    assert (info.value.status, info.value.param) == (400, "n")


def test_unknown_model_is_404():
    with pytest.raises(APIError) as info:
        router(Pool("m", [Worker("a")])).route("other")
    assert (info.value.status, info.value.code, info.value.param) == (404, "model_not_found", "model")


def test_no_ready_worker_is_503():
    with pytest.raises(APIError) as info:
        router(Pool("m", [Worker("a", ready=False)])).route("m")
    assert info.value.status == 503


def test_fallback_chain_is_followed_once_each():
    down = [Worker("a", ready=False)]
    r = router(Pool("m", down, ["f1"]), Pool("f1", [Worker("b", ready=False)], ["f2", "m"]),
               Pool("f2", [Worker("c")], ["m"]))
    assert [p.name for p in r.chain("m")] == ["m", "f1", "f2"]
    pool, worker = r.route("m")
    assert (pool.name, worker.label) == ("f2", "c")


def test_cyclic_fallbacks_all_down_end_in_503():
    r = router(Pool("m", [Worker("a", ready=False)], ["f"]), Pool("f", [Worker("b", ready=False)], ["m"]))
    with pytest.raises(APIError) as info:
        r.route("m")
    assert info.value.status == 503


def test_a_fallback_the_key_may_not_use_is_skipped_as_if_absent():
    # "public" is down and falls back to "secret", then "open"; the key may use "public" and "open".
    r = router(Pool("public", [Worker("p", ready=False)], ["secret", "open"]),
               Pool("secret", [Worker("s")], ["hidden"]), Pool("hidden", [Worker("h")]),
               Pool("open", [Worker("o")]))
    allowed = {"public", "open"}.__contains__
    assert [p.name for p in r.chain("public", allowed)] == ["public", "open"]
    pool, worker = r.route("public", may_use=allowed)
    assert (pool.name, worker.label) == ("open", "o")
    # Nor do its errors name it: with "open" down too, a 503 for "public" (not a 429 or 400 of "secret").
    r.pools["open"].workers[0].ready = False
    r.pools["secret"].workers[0].load = 4
    for n in (1, 99):
        with pytest.raises(APIError) as info:
            r.route("public", n, may_use=allowed)
        assert info.value.status == 503 and "secret" not in info.value.message
    with pytest.raises(APIError) as info:
        r.route("secret", may_use=allowed)
    assert info.value.status == 404 and info.value.code == "model_not_found"


def test_worker_labels():
    assert worker_labels(["npu:0", "npu:1", "musa:0"]) == ["npu:0", "npu:1", "musa:0"]
    assert worker_labels(["cpu", "npu:0", "cpu"]) == ["cpu#0", "npu:0", "cpu#1"]


def test_replacement_is_the_least_loaded_ready_worker_of_the_same_pool():
    pool = Pool("m", [Worker("dead", ready=False), Worker("busy", load=3), Worker("idle", load=1)], ["f"])
    r = router(pool, Pool("f", [Worker("x")]))
    assert asyncio.run(r.replacement(pool, 1, wait_s=0)).label == "idle"
    assert asyncio.run(r.replacement(pool, 4, wait_s=0)) is None  # no room, and never a fallback model


def test_replacement_waits_for_a_worker_to_come_back():
    restarted = Worker("a", ready=False)
    pool = Pool("m", [restarted])

    async def go():
        pending = asyncio.ensure_future(router(pool).replacement(pool, 1, wait_s=60))
        await asyncio.sleep(0)
        assert not pending.done()
        restarted.ready = True
        return await pending

    assert asyncio.run(go()) is restarted
