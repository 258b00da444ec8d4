"""The runtime LoRA endpoints and adapter requests, in process: the app's real routes, router and pools
over stand-in workers whose engines answer LoadLora / UnloadLora at once (``refuse``: path -> the
engine's error). Pinned here: the opt-in, vLLM's bodies and statuses, every worker of a model loading
(or none keeping) an adapter, key scoping, and a request naming an adapter reaching a worker with it."""

import asyncio
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.stand_in_worker import StandInWorker
from xinserve.server.api.openai.view import TokenTexts
from xinserve.server.app import create_app
from xinserve.server.config import parse_config
from xinserve.server.lora.routes import RUNTIME_UPDATING_ENV, runtime_updating_allowed
from xinserve.server.pool.worker_loras import WorkerLoras
from xinserve.server.worker.engine_worker import WorkerSpec
from xinserve.server.worker.messages import LoadLora, LoraDone, RequestError, UnloadLora

KEYS = {"admin": "sk-admin-0c4e1b", "plain-only": "sk-plain-77a0d3"}  # "plain-only" may use model "plain" only


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


class LoraWorker(StandInWorker):
    """A ready stand-in worker holding ``held`` adapters; its engine refuses the paths in ``refuse``."""

    def __init__(self, label: str, model: str, held: tuple[str, ...] = (), refuse: dict[str, RequestError] | None = None):
        super().__init__(3, "length")
        self.label, self.model_name = label, model
        self.refuse = refuse or {}
        self.held = set(held)
        self.sent: list[LoadLora | UnloadLora] = []
        self.added: list = []  # the params of each request it got
        self.loras = WorkerLoras(self._post, label)
        self.loras.started(sorted(held))
        self.spec = WorkerSpec(model, label, "cpu", "/m", {"lora_modules": None}, "ipc://in", "ipc://out")

    def _post(self, message: LoadLora | UnloadLora) -> bool:
        self.sent.append(message)
        error = self.refuse.get(message.path) if isinstance(message, LoadLora) else None
        if error is None:
            (self.held.add if isinstance(message, LoadLora) else self.held.discard)(message.name)
        answer = LoraDone(message.op, error, sorted(self.held))
        asyncio.get_running_loop().call_soon(self.loras.done, answer)
        return True

    def add(self, request_id, prompt_token_ids, params):
        self.added.append(params)
        return super().add(request_id, prompt_token_ids, params)


@pytest.fixture
def sql_dir(tmp_path) -> Path:
    (tmp_path / "adapter_config.json").write_text("{}")
    return tmp_path


def make_app(tokenizer, sql_dir: Path, workers: dict[str, list[LoraWorker]]):
    config = parse_config({
        "server": {"api_keys": [{"name": "admin", "key": KEYS["admin"]},
                                {"name": "plain-only", "key": KEYS["plain-only"], "models": ["plain"]}]},
        "models": [{"name": "m", "path": "/nonexistent", "enable_lora": True, "lora_modules": {"sql": str(sql_dir)}},
                   {"name": "plain", "path": "/nonexistent"}],
    })
    app = create_app(config)
    for name, pool in app.state.router.pools.items():
        pool.tokenizer, pool.token_texts, pool.workers = tokenizer, TokenTexts(tokenizer), workers[name]
    return app


@pytest.fixture
def served(tiny_tokenizer, sql_dir, monkeypatch):
    """(app, workers): model "m" on two workers holding "sql", model "plain" (no LoRA) on one."""
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    workers = {"m": [LoraWorker("cpu#0", "m", ("sql",)), LoraWorker("cpu#1", "m", ("sql",))],
               "plain": [LoraWorker("cpu#2", "plain")]}
    return make_app(tiny_tokenizer, sql_dir, workers), workers


def call(app, *requests: tuple[str, str, dict | None], key: str = "admin") -> list[httpx.Response]:
    """(method, path, json body) requests in turn, with ``key``."""
    async def go():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=auth(key)) as c:
            return [await c.request(method, path, json=body) for method, path, body in requests]

    return asyncio.run(go())


def load(name: str | None, path: str | None, **more) -> tuple[str, str, dict]:
    body = {k: v for k, v in (("lora_name", name), ("lora_path", path)) if v is not None}
    return "POST", "/v1/load_lora_adapter", {**body, **more}


def unload(name: str | None) -> tuple[str, str, dict]:
    return "POST", "/v1/unload_lora_adapter", {} if name is None else {"lora_name": name}


def chat(model: str) -> tuple[str, str, dict]:
    return "POST", "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}]}


def model_ids(app, key: str = "admin") -> list[str]:
    return [card["id"] for card in call(app, ("GET", "/v1/models", None), key=key)[0].json()["data"]]


@pytest.mark.parametrize(("env", "allowed"), [
    ({}, False), ({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}, True),
    ({"XINSERVE_ALLOW_RUNTIME_LORA_UPDATING": "1"}, True), ({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "false"}, False),
    ({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": " TRUE "}, True), ({"XINSERVE_ALLOW_RUNTIME_LORA_UPDATING": "yes"}, False),
])
def test_runtime_updating_is_opt_in(env, allowed):
    assert runtime_updating_allowed(env) is allowed


def test_without_the_opt_in_the_endpoints_do_not_exist(tiny_tokenizer, sql_dir, monkeypatch):
    for name in RUNTIME_UPDATING_ENV:
        monkeypatch.delenv(name, raising=False)
    app = make_app(tiny_tokenizer, sql_dir, {"m": [LoraWorker("cpu", "m", ("sql",))], "plain": []})
    for r in call(app, load("new", str(sql_dir)), unload("sql")):
        assert r.status_code == 404 and "error" in r.json()
    assert "sql" in model_ids(app)  # the configured adapters still serve


def test_a_load_reaches_every_worker_then_requests_may_name_it(served, sql_dir):
    app, workers = served
    r, models, answer = call(app, load("new", str(sql_dir)), ("GET", "/v1/models/new", None), chat("new"))
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'new' added successfully.")
    for worker in workers["m"]:
        assert [(type(m), m.name, m.path) for m in worker.sent] == [(LoadLora, "new", str(sql_dir))]
        assert worker.loras.names == {"sql", "new"}
        assert worker.spec.engine_kwargs["lora_modules"] == {"sql": str(sql_dir), "new": str(sql_dir)}  # restarts
    assert models.json() == {"id": "new", "object": "model", "created": models.json()["created"],
                             "owned_by": "xinserve", "root": str(sql_dir), "parent": "m"}
    assert answer.status_code == 200 and answer.json()["model"] == "new"
    (params,) = [p for w in workers["m"] for p in w.added]
    assert params.lora_name == "new"


def test_a_load_that_fails_on_one_worker_is_undone_on_the_others(served, tmp_path):
    app, workers = served
    refusal = RequestError("LoRA adapter '/bad': layers.0.mlp.down_proj has rank 32, more than max_lora_rank 16",
                           client_fault=True)
    workers["m"][1].refuse = {"/bad": refusal}
    r, answer = call(app, load("big", "/bad"), chat("big"))
    assert r.status_code == 400
    assert r.json()["error"] == {"message": f"cannot load LoRA adapter 'big': {refusal.message}",
                                 "type": "invalid_request_error", "param": "lora_path", "code": None}
    assert [type(m) for m in workers["m"][0].sent] == [LoadLora, UnloadLora]
    assert all(w.loras.names == {"sql"} for w in workers["m"])
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found"
    assert "big" not in model_ids(app)


@pytest.mark.parametrize(("request_", "status", "param", "message"), [
    (load(None, "/x"), 400, "lora_name", "Both 'lora_name' and 'lora_path' must be provided."),
    (load("x", None), 400, "lora_path", "Both 'lora_name' and 'lora_path' must be provided."),
    (load("  ", "/x"), 400, "lora_name", "Both 'lora_name' and 'lora_path' must be provided."),
    (load(3, "/x"), 400, "lora_name", "Invalid value for 'lora_name'"),
    (load("sql", "/x"), 400, "lora_name", "The lora adapter 'sql' has already been loaded."),
    (load("plain", "/x"), 400, "lora_name", "'plain' is the name of a served model"),
    (load("x", "/x", base_model_name="nope"), 404, "base_model_name", "The model 'nope' does not exist."),
    (load("x", "/x", base_model_name="plain"), 400, "base_model_name", "does not serve LoRA adapters"),
    (unload(None), 400, "lora_name", "'lora_name' needs to be provided to unload a LoRA adapter."),
    (unload("nope"), 404, "lora_name", "The lora adapter 'nope' cannot be found."),
    (unload("m"), 404, "lora_name", "The lora adapter 'm' cannot be found."),
])
def test_bad_updates_get_4xx_and_change_nothing(served, request_, status, param, message):
    app, workers = served
    (r,) = call(app, request_)
    error = r.json()["error"]
    assert (r.status_code, error["param"]) == (status, param) and message in error["message"]
    assert all(w.sent == [] for ws in workers.values() for w in ws)
    assert model_ids(app) == ["m", "sql", "plain"]


def test_a_limited_key_updates_only_its_own_models(served, sql_dir):
    app, workers = served
    on_m, with_base, off = call(app, load("x", str(sql_dir)), load("x", str(sql_dir), base_model_name="m"),
                                unload("sql"), key="plain-only")
    assert on_m.status_code == 400 and "No served model has LoRA enabled" in on_m.json()["error"]["message"]
    assert with_base.status_code == 404 and off.status_code == 404  # to this key, "m" and "sql" do not exist
    assert model_ids(app, "plain-only") == ["plain"]
    (r,) = call(app, chat("sql"), key="plain-only")
    assert r.status_code == 404 and r.json()["error"]["message"] == "The model 'sql' does not exist."
    assert all(w.sent == [] for ws in workers.values() for w in ws)


def test_an_unload_stops_new_requests_and_reaches_every_worker(served):
    app, workers = served
    before, r, after, listed = call(app, chat("sql"), unload("sql"), chat("sql"), ("GET", "/v1/models/sql", None))
    assert before.status_code == 200 and before.json()["model"] == "sql"
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql' removed successfully.")
    assert after.status_code == 404 and listed.status_code == 404
    for worker in workers["m"]:
        assert [(type(m), m.name) for m in worker.sent] == [(UnloadLora, "sql")]
        assert worker.loras.names == set() and worker.spec.engine_kwargs["lora_modules"] is None


def test_a_load_with_no_ready_worker_is_503(served, sql_dir):
    app, workers = served
    for worker in workers["m"]:
        worker.ready = False
    (r,) = call(app, load("new", str(sql_dir)))
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_unavailable"


def test_an_adapter_request_counts_per_adapter_and_tokenizes_with_its_base(served):
    app, _ = served
    base_ids = call(app, ("POST", "/tokenize", {"model": "m", "prompt": "hello there"}))[0].json()["tokens"]
    r, tokens, metrics = call(app, chat("sql"), ("POST", "/tokenize", {"model": "sql", "prompt": "hello there"}),
                              ("GET", "/metrics", None))
    assert tokens.json()["tokens"] == base_ids
    counters = {s.name: s.value for family in text_string_to_metric_families(metrics.text) for s in family.samples
                if s.name.startswith("xinserve:lora_") and s.name.endswith("_total")}
    usage = r.json()["usage"]
    assert counters == {"xinserve:lora_requests_total": 1.0,
                        "xinserve:lora_prompt_tokens_total": float(usage["prompt_tokens"]),
                        "xinserve:lora_generation_tokens_total": float(usage["completion_tokens"])}



@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling", "/classify"])
def test_a_pooling_request_naming_an_adapter_is_a_400_and_reaches_no_worker(served, path):
    """Pooling runs on the base model only: an adapter named as its model is refused before any worker."""
    app, workers = served
    (r,) = call(app, ("POST", path, {"model": "sql", "input": "hi"}))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("model", "model_not_supported") and "LoRA adapter" in error["message"]
    assert all(not w.added for ws in workers.values() for w in ws)
