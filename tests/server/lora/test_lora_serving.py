"""End to end: ``xinserve serve`` on the tiny Llama with two LoRA adapters made by PEFT (the engine tests'
builder) over two CPU workers, driven with the openai SDK. Each adapter's greedy output equals
transformers + PEFT's on the same weights, and the base model's stays the base's, with all three mixed
in flight; a runtime load and unload under concurrent traffic fails no request (requests running with
the unloaded adapter finish with it); every bad input is a 4xx; /v1/models, /health and /metrics show
the adapters."""

import asyncio
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.engines.lora.conftest import ALL_TARGETS, PeftReference, make_adapter

MAX_TOKENS = 8
PROMPTS = [[1, 5, 9, 13, 17], [1, 200, 31, 7], [1, 42, 42, 42, 42, 42, 3], [1, 99]]
# name -> (rank, target modules, seed); "big" is past the server's max_lora_rank 16
ADAPTERS = {"sql": (8, ALL_TARGETS, 1), "chat": (4, ["q_proj", "v_proj"], 2),
            "extra": (16, ["gate_proj", "up_proj", "down_proj"], 3), "big": (32, ["q_proj"], 4)}
RUNTIME = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}
# A server of its own (two workers) plus four adapters and PEFT's reference: past 20 s on 2 cores.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server-lora")
    return {name: make_adapter(tiny_model_dir, root / name, rank, targets, seed=seed)
            for name, (rank, targets, seed) in ADAPTERS.items()}


@pytest.fixture(scope="module")
def expected(tiny_model_dir, tiny_tokenizer, adapters) -> dict[tuple[str | None, int], str]:
    """(adapter or None, prompt index) -> transformers + PEFT's greedy text."""
    reference = PeftReference(tiny_model_dir, {n: adapters[n] for n in ("sql", "chat", "extra")}, MAX_TOKENS)
    return {(name, i): tiny_tokenizer.decode(reference.generate(prompt, name), skip_special_tokens=True)
            for name in (None, "sql", "chat", "extra") for i, prompt in enumerate(PROMPTS)}


@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir, adapters, tmp_path_factory):
    """Model "tiny" on two CPU workers (each loads every adapter) with 2 device slots for 3 adapters."""
    config = {"models": [{
        "name": "tiny", "path": str(tiny_model_dir), "workers": ["cpu", "cpu"], "cpu_threads": 1,
        "max_model_len": 256, "enable_lora": True, "max_loras": 2, "max_lora_rank": 16,
        "lora_modules": {"sql": str(adapters["sql"]), "chat": str(adapters["chat"])}}]}
    path = tmp_path_factory.mktemp("lora-server") / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    srv = start_server(["--config", str(path)], env=RUNTIME)
    srv.wait_ready()
    return srv


def completions(url: str, jobs: list[tuple[str, int]], **more) -> list:
    """One greedy completion per (model, prompt index), all at once through the openai SDK."""
    async def run() -> list:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(client.completions.create(
                model=model, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0, **more) for model, i in jobs))

    return asyncio.run(run())


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def test_each_adapter_matches_peft_and_the_base_stays_the_base(server, expected):
    assert any(expected["sql", i] != expected[None, i] for i in range(len(PROMPTS)))  # the adapters change outputs
    assert any(expected["chat", i] != expected[None, i] for i in range(len(PROMPTS)))
    jobs = [(model, i) for i in range(len(PROMPTS)) for model in ("tiny", "sql", "chat")]
    for (model, i), answer in zip(jobs, completions(server.url, jobs), strict=True):
        assert answer.model == model
        assert answer.choices[0].text == expected[None if model == "tiny" else model, i], (model, i)


def test_every_generation_api_takes_an_adapter_by_its_model_name(server, expected):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == "sql" and chat.usage.completion_tokens > 0
    response = client.responses.create(model="chat", input="hi", max_output_tokens=4)
    assert response.model == "chat" and response.status in ("completed", "incomplete")
    message = post(server.url, "/v1/messages", {"model": "sql", "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": "hi"}]})
    assert message.status_code == 200 and message.json()["model"] == "sql"
    stream = client.completions.create(model="chat", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected["chat", 0]


def test_a_runtime_load_and_unload_under_traffic_fail_no_request(server, adapters, expected):
    async def traffic(client: openai.AsyncOpenAI, stop: asyncio.Event, done: list) -> None:
        turn = 0
        while not stop.is_set():
            model, i = ("tiny", "sql", "chat")[turn % 3], turn % len(PROMPTS)
            answer = await client.completions.create(model=model, prompt=PROMPTS[i], max_tokens=MAX_TOKENS,
                                                     temperature=0)
            assert answer.choices[0].text == expected[None if model == "tiny" else model, i]
            done.append(model)
            turn += 1

    async def main() -> None:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                                      timeout=120) as client, httpx.AsyncClient(base_url=server.url,
                                                                                timeout=120) as http:
            stop, done = asyncio.Event(), []
            background = [asyncio.ensure_future(traffic(client, stop, done)) for _ in range(3)]
            loaded = await http.post("/v1/load_lora_adapter", json={"lora_name": "extra",
                                                                    "lora_path": str(adapters["extra"])})
            assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'extra' added successfully.")
            first = await client.completions.create(model="extra", prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                                    temperature=0)
            assert first.choices[0].text == expected["extra", 1]
            # long requests with the adapter, running (their first tokens are out: a stream's headers come
            # with them) when it is unloaded: they finish with it
            streams = await asyncio.gather(*(client.completions.create(
                model="extra", prompt=PROMPTS[i], max_tokens=48, temperature=0, stream=True,
                extra_body={"ignore_eos": True}) for i in range(len(PROMPTS))))
            unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": "extra"})
            assert unloaded.status_code == 200
            with pytest.raises(openai.NotFoundError):
                await client.completions.create(model="extra", prompt=PROMPTS[0], max_tokens=2)
            for i, stream in enumerate(streams):
                text, reasons = "", []
                async for chunk in stream:
                    text += chunk.choices[0].text
                    reasons.append(chunk.choices[0].finish_reason)
                assert reasons[-1] == "length" and text.startswith(expected["extra", i])
            stop.set()
            await asyncio.gather(*background)  # any failed request fails the test here
            assert {"tiny", "sql", "chat"} <= set(done)

    asyncio.run(main())
    health = httpx.get(f"{server.url}/health").json()
    assert health["lora_adapters"] == {"tiny": ["chat", "sql"]}
    assert [w["lora_adapters"] for w in health["workers"]] == [["chat", "sql"], ["chat", "sql"]]


@pytest.mark.parametrize(("path", "body", "status", "message"), [
    ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
    ("/v1/load_lora_adapter", {"lora_path": "/x"}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent/adapter"}, 400, "adapter_config.json"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "big"}, 400, "max_lora_rank 16"),
    ("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "extra"}, 400, "has already been loaded"),
    ("/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": "extra"}, 400, "the name of a served model"),
    ("/v1/unload_lora_adapter", {}, 400, "'lora_name' needs to be provided"),
    ("/v1/unload_lora_adapter", {"lora_name": "nope"}, 404, "The lora adapter 'nope' cannot be found."),
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "The model 'nope' does not exist."),
    ("/v1/chat/completions", {"model": "sq", "messages": [{"role": "user", "content": "hi"}]}, 404,
     "The model 'sq' does not exist."),
])
def test_bad_input_is_4xx_with_openais_error(server, adapters, path, body, status, message):
    if body.get("lora_path") in adapters:
        body = {**body, "lora_path": str(adapters[body["lora_path"]])}
    r = post(server.url, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"] and set(error) == {"message", "type", "param", "code"}
    assert httpx.get(f"{server.url}/health").json()["lora_adapters"]["tiny"] == ["chat", "sql"]


def test_models_and_metrics_show_the_adapters(server, adapters):
    completions(server.url, [("sql", 0)])
    cards = {card["id"]: card for card in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert set(cards) == {"tiny", "sql", "chat"}
    assert (cards["sql"]["root"], cards["sql"]["parent"], cards["sql"]["object"]) == (str(adapters["sql"]), "tiny",
                                                                                       "model")
    assert httpx.get(f"{server.url}/v1/models/chat").json()["parent"] == "tiny"
    samples = [s for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text) for s in f.samples]
    info = [s for s in samples if s.name == "xinserve:lora_requests_info"]
    assert len(info) == 2 and all(s.labels["max_lora"] == "2" for s in info)
    requests = {s.labels["lora_name"]: s.value for s in samples if s.name == "xinserve:lora_requests_total"}
    assert requests["sql"] >= 1 and set(requests) <= {"sql", "chat", "extra"}
    tokens = [s for s in samples if s.name == "xinserve:lora_generation_tokens_total" and s.labels["lora_name"] == "sql"]
    assert tokens[0].value >= requests["sql"] and tokens[0].labels["model_name"] == "tiny"
