"""The Responses store's bounds: entries and bytes per API key, so that one key's traffic evicts only
its own responses; and what may reach it: ``metadata`` within OpenAI's limits, every part of the
input that reaches the prompt within ``limits.max_prompt_chars``. The store directly, then once
through the in-process app (tests/server/stand_in_worker.py)."""

import asyncio

import httpx
import pytest

from tests.server.stand_in_worker import StandInWorker, auth, make_app
from xinserve.server.api.responses.store import ResponseStore
from xinserve.server.errors import APIError


def put(store: ResponseStore, owner: str, i: int, pad: int = 0) -> str:
    response_id = f"resp_{owner}{i}"
    store.put(owner, {"id": response_id, "pad": "x" * pad}, [{"role": "user", "content": "hi"}])
    return response_id


def kept(store: ResponseStore, owner: str, response_id: str) -> bool:
    try:
        store.get(response_id, owner)
    except APIError:
        return False
    return True


def test_a_keys_entries_are_evicted_only_by_its_own_traffic():
    store = ResponseStore(max_entries=3, max_bytes=1 << 20, ttl_s=3600)
    first = put(store, "team-a", 0)
    flood = [put(store, "team-b", i) for i in range(100)]
    assert kept(store, "team-a", first)
    assert [kept(store, "team-b", r) for r in flood[-4:]] == [False, True, True, True]
    newer = [put(store, "team-a", i) for i in range(1, 4)]
    assert not kept(store, "team-a", first) and all(kept(store, "team-a", r) for r in newer)


def test_each_key_is_held_to_its_byte_budget():
    store = ResponseStore(max_entries=1000, max_bytes=10_000, ttl_s=3600)
    ids = [put(store, "", i, pad=3_000) for i in range(5)]  # requests without a key share one budget
    assert [kept(store, "", r) for r in ids] == [False, False, True, True, True]
    assert store.bytes_held("") <= 10_000
    other = put(store, "team-a", 0, pad=3_000)
    assert kept(store, "team-a", other) and all(kept(store, "", r) for r in ids[2:])


def test_an_entry_over_the_whole_budget_is_not_kept_and_evicts_nothing():
    store = ResponseStore(max_entries=1000, max_bytes=10_000, ttl_s=3600)
    small = put(store, "team-a", 0)
    big = put(store, "team-a", 1, pad=20_000)
    assert kept(store, "team-a", small) and not kept(store, "team-a", big)


def test_deleting_and_expiring_give_the_bytes_back():
    store = ResponseStore(max_entries=10, max_bytes=10_000, ttl_s=3600)
    r = put(store, "team-a", 0, pad=3_000)
    store.delete(r, "team-a")
    assert store.bytes_held("team-a") == 0
    expiring = ResponseStore(max_entries=10, max_bytes=10_000, ttl_s=0)
    put(expiring, "team-a", 0, pad=3_000)
    assert not kept(expiring, "team-a", "resp_team-a0") and expiring.bytes_held("team-a") == 0


def post(app, key: str, body: dict, method: str = "POST", path: str = "/v1/responses") -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=auth(key)) as c:
            return await c.request(method, path, json=body if method == "POST" else None)

    return asyncio.run(go())


BODY = {"model": "m", "input": "hello there", "max_output_tokens": 20}


def test_another_keys_flood_leaves_a_keys_responses_in_place(tiny_tokenizer):
    app = make_app(tiny_tokenizer, StandInWorker(2, "stop"), responses_store={"max_entries_per_key": 2})
    mine = post(app, "team-a", BODY).json()["id"]
    for _ in range(4):
        assert post(app, "team-b", BODY).status_code == 200
    assert post(app, "team-a", {}, "GET", f"/v1/responses/{mine}").status_code == 200
    follow = post(app, "team-a", {**BODY, "previous_response_id": mine})
    assert follow.status_code == 200, follow.text


CALL = {"type": "function_call", "call_id": "call_1", "name": "f"}


@pytest.mark.parametrize(("body", "param"), [
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"metadata": {"k": "m" * 513}}, "metadata"),
    ({"input": [{**CALL, "arguments": "x" * 1_000_001}]}, "input"),
    ({"input": [{**CALL, "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "x" * 1_000_001}]}, "input"),
    ({"instructions": "x" * 1_000_001}, "input"),
])
def test_input_beyond_the_limits_is_a_400_naming_the_field(tiny_tokenizer, body, param):
    app = make_app(tiny_tokenizer, StandInWorker(2, "stop"))
    r = post(app, "team-a", {**BODY, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
