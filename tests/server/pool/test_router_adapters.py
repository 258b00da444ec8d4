"""A request's model naming a LoRA adapter: ``Router.resolve`` finds its base model, the route goes only to
that model's workers that hold the adapter (never to a fallback), and a key may use it with its base."""

import asyncio

import pytest

from tests.server.pool.routing_fakes import Pool, Worker, any_model, router
from xinserve.server.errors import APIError
from xinserve.server.pool.router import Target


def served() -> tuple:
    """Model "m" (adapters sql and chat; worker "a" holds both, "b" only chat) falling back to "f"."""
    a, b = Worker("a", loras=("sql", "chat")), Worker("b", load=0, loras=("chat",))
    return router(Pool("m", [a, b], fallback=["f"], adapters={"sql": "/sql", "chat": "/chat"}),
                  Pool("f", [Worker("x")])), a, b


def test_a_model_name_resolves_to_itself_an_adapter_to_its_base():
    r, _, _ = served()
    assert r.resolve("m") == Target("m", "m", None)
    assert r.resolve("sql") == Target("sql", "m", "sql")


@pytest.mark.parametrize("name", ["nope", "/sql", "SQL"])
def test_an_unknown_name_is_404_model_not_found(name):
    r, _, _ = served()
    with pytest.raises(APIError) as info:
        r.resolve(name, any_model)
    assert (info.value.status, info.value.code, info.value.param) == (404, "model_not_found", "model")


def test_a_key_uses_an_adapter_exactly_when_it_may_use_its_base():
    r, _, _ = served()
    assert r.resolve("sql", lambda name: name == "m").base == "m"
    with pytest.raises(APIError) as info:
        r.resolve("sql", lambda name: name == "f")
    assert info.value.status == 404 and "'sql' does not exist" in info.value.message


def test_an_adapter_request_goes_only_to_workers_that_hold_it():
    r, a, b = served()
    b.load, a.load = 0, 3  # b is idler but has no "sql"
    assert [r.route(r.resolve("sql"))[1].label for _ in range(3)] == ["a", "a", "a"]
    assert r.route(r.resolve("chat"))[1].label == "b"
    assert r.route("m")[1].label == "b"


def test_an_adapter_never_falls_back_to_another_model():
    r, a, b = served()
    a.ready = False  # the one worker that holds "sql"
    with pytest.raises(APIError) as info:
        r.route(r.resolve("sql"))
    assert info.value.status == 503 and "'sql'" in info.value.message
    assert r.route(r.resolve("chat"))[1].label == "b"
    b.ready = False
    assert r.route("m")[0].name == "f"  # the base model itself still falls back


def test_a_retry_of_an_adapter_request_waits_for_a_worker_that_holds_it():
    r, a, b = served()
    pool = r.pools["m"]
    assert asyncio.run(r.replacement(pool, 1, wait_s=0.0, lora_name="sql")) is a
    a.ready = False
    assert asyncio.run(r.replacement(pool, 1, wait_s=0.2, lora_name="sql")) is None
    assert asyncio.run(r.replacement(pool, 1, wait_s=0.0)) is b


def test_an_adapter_unloaded_after_its_request_resolved_is_404_not_503():
    r, _, _ = served()
    target = r.resolve("sql")
    del r.pools["m"].adapters["sql"]  # the unload's first step, while the request tokenised its prompt
    with pytest.raises(APIError) as info:
        r.route(target)
    assert (info.value.status, info.value.code) == (404, "model_not_found")
