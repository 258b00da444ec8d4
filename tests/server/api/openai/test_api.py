"""End to end against one real server: the embedded default, started from an empty cache directory.

Driven with the official ``openai`` SDK and raw ``httpx``; every body, chunk and error is checked
against OpenAI's published schemas.
"""

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import EMBEDDED_KEY, check_chat_stream, concurrent_greedy_chats, sse_events

MODEL = "xinserve-tiny"
KEY = EMBEDDED_KEY
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(embedded_server):
    # No --config and no --model: the README's first command, on a clean cache, offline.
    return embedded_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c


def metric_values(server, name: str) -> dict[tuple, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def chat_body(**kw) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the river."}],
            "max_tokens": 8, **kw}


# ---------------------------------------------------------------- start-up and models


def test_embedded_default_built_in_clean_cache(server):
    assert (server.cache / MODEL / "config.json").is_file()
    assert "building embedded model" in server.log()


def test_models_list_and_retrieve(http, schemas):
    body = http.get("/v1/models").json()
    schemas.validate("ListModelsResponse", body)
    assert [m["id"] for m in body["data"]] == [MODEL]
    card = http.get(f"/v1/models/{MODEL}").json()
    schemas.validate("Model", card)
    assert card["max_model_len"] == 2048


def test_health_is_open_and_reports_workers(server):
    r = httpx.get(f"{server.url}/health")  # no key: /health is exempt by default
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok"
    assert [(w["model"], w["worker"], w["state"]) for w in body["workers"]] == [(MODEL, "cpu", "ready")]
    kernels = body["workers"][0]["kernels"]  # the kernel registry's choice on the worker's device
    assert kernels["rms_norm"] == {"chosen": "reference", "rejected": []}
    decode = kernels["decode_attention"]
    # By speed among the built candidates; the reference alone while the C++ kernel builds (a fresh machine).
    assert decode["chosen"] in decode.get("timings_ms", {"reference": None})
    # one device: rank 0 of a one-rank replica, the whole model
    assert body["workers"][0]["ranks"][0]["role"] == {"tp_rank": 0, "pp_stage": 0, "expert_range": None, "layers": None}
    # its torch threads: timed at start against every core unless set (engines/worker/thread_split.py)
    threads = body["workers"][0]["info"]["cpu_threads"]
    assert threads["threads"] >= 1 and threads["source"] in ("measured", "cached", "fixed")


# ---------------------------------------------------------------- chat


def test_chat_non_stream(client, http, schemas):
    raw = http.post("/v1/chat/completions", json=chat_body(temperature=0))
    assert raw.status_code == 200
    body = raw.json()
    schemas.validate("CreateChatCompletionResponse", body)
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["refusal"] is None
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 8
    assert body["id"].startswith("chatcmpl-") and raw.headers["x-request-id"]  # ids: made by the server
    # The SDK parses the same request, and greedy decoding repeats itself.
    sdk = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about the river."}], max_tokens=8,
        temperature=0,
    )
    assert sdk.choices[0].message.content == choice["message"]["content"]
    assert sdk.usage.completion_tokens == 8


def test_chat_content_parts_and_roles(http, schemas):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Bake bread?"},
    ]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_completion_tokens": 3})
    assert r.status_code == 200, r.text
    schemas.validate("CreateChatCompletionResponse", r.json())
    assert r.json()["usage"]["completion_tokens"] == 3


def test_chat_stream_chunks(http, schemas):
    body = chat_body(stream=True, stream_options={"include_usage": True}, temperature=0, max_tokens=6)
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    streamed = check_chat_stream(events, schemas, completion_tokens=6)
    whole = http.post("/v1/chat/completions", json=chat_body(temperature=0, max_tokens=6)).json()
    assert streamed == whole["choices"][0]["message"]["content"]


def test_chat_stream_with_sdk(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 5


def test_chat_logprobs(http, schemas):
    body = chat_body(temperature=0, max_tokens=4, logprobs=True, top_logprobs=3)
    data = http.post("/v1/chat/completions", json=body).json()
    schemas.validate("CreateChatCompletionResponse", data)
    content = data["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert len(entry["top_logprobs"]) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"], abs=1e-4)
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        chunks = [e for e in sse_events(r) if e != "[DONE]"]
    for chunk in chunks:
        schemas.validate("CreateChatCompletionStreamResponse", chunk)
    streamed = [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-4)


def test_chat_n_and_seed(http, schemas):
    body = chat_body(n=3, temperature=1.0, seed=1234, max_tokens=6)
    first = http.post("/v1/chat/completions", json=body).json()
    schemas.validate("CreateChatCompletionResponse", first)
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert first["usage"]["completion_tokens"] == 18
    again = http.post("/v1/chat/completions", json=body).json()
    assert [c["message"]["content"] for c in again["choices"]] == [c["message"]["content"] for c in first["choices"]]


def test_stop_string_cuts_text(http):
    base = http.post("/v1/chat/completions", json=chat_body(temperature=0, max_tokens=24)).json()
    text = base["choices"][0]["message"]["content"]
    # A stop string taken from the middle of the greedy text: the output must end right before it.
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip() and "\ufffd" not in
                text[i:i + 2])
    cut = text[: text.index(stop)]
    for stream in (False, True):
        body = chat_body(temperature=0, max_tokens=24, stop=[stop], stream=stream)
        if stream:
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                chunks = [e for e in sse_events(r) if e != "[DONE]"]
            got = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
            reason = next(c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"])
        else:
            data = http.post("/v1/chat/completions", json=body).json()
            got, reason = data["choices"][0]["message"]["content"], data["choices"][0]["finish_reason"]
        assert got == cut
        assert reason == "stop"


# ---------------------------------------------------------------- completions


def test_completions_forms(http, client, schemas):
    single = http.post("/v1/completions", json={"model": MODEL, "prompt": "The river", "max_tokens": 5,
                                                 "temperature": 0}).json()
    schemas.validate("CreateCompletionResponse", single)
    assert single["object"] == "text_completion" and single["usage"]["completion_tokens"] == 5
    many = http.post("/v1/completions", json={"model": MODEL, "prompt": ["The river", "A small library"],
                                               "max_tokens": 5, "temperature": 0, "n": 2}).json()
    schemas.validate("CreateCompletionResponse", many)
    assert [c["index"] for c in many["choices"]] == [0, 1, 2, 3]
    assert many["choices"][0]["text"] == single["choices"][0]["text"]
    ids = client.completions.create(model=MODEL, prompt=[0, 46, 436], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens == 3
    echo = http.post("/v1/completions", json={"model": MODEL, "prompt": "The river", "max_tokens": 5,
                                               "temperature": 0, "echo": True}).json()
    assert echo["choices"][0]["text"] == "The river" + single["choices"][0]["text"]


def test_completions_logprobs_and_stream(http, schemas):
    body = {"model": MODEL, "prompt": "The river", "max_tokens": 4, "temperature": 0, "logprobs": 2}
    data = http.post("/v1/completions", json=body).json()
    schemas.validate("CreateCompletionResponse", data)
    lp = data["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert lp["text_offset"][0] == 0
    with http.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                       "stream_options": {"include_usage": True}}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == data["choices"][0]["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    schemas.validate("CreateCompletionResponse", final[-1])


# ---------------------------------------------------------------- errors


BAD_CHAT = [
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"max_tokens": 5000}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"messages": "hello"}, "messages"),
    ({"n": "2"}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"model": None}, "model"),
    ({"chat_template_kwargs": {"chat_template": "{{ 'ab ' * 2000000 }}"}}, "chat_template_kwargs.chat_template"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),
]


@pytest.mark.parametrize(("override", "param"), BAD_CHAT, ids=[p for _, p in BAD_CHAT])
def test_chat_invalid_values_are_400(http, schemas, override, param):
    r = http.post("/v1/chat/completions", json={**chat_body(), **override})
    assert r.status_code == 400, r.text
    schemas.validate("ErrorResponse", r.json())
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_context_length_error_code(http):
    error = http.post("/v1/chat/completions", json=chat_body(max_tokens=5000)).json()["error"]
    assert error["code"] == "context_length_exceeded" and "2048" in error["message"]
    long_prompt = " ".join(["river"] * 2100)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "prompt"
    r = http.post("/v1/chat/completions", json=chat_body(max_tokens=None, max_completion_tokens=4000))
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"


def test_malformed_json_and_missing_fields(http, schemas):
    r = http.post("/v1/chat/completions", content=b'{"model": "x", "messages": [', headers={
        "content-type": "application/json"})
    assert r.status_code == 400
    schemas.validate("ErrorResponse", r.json())
    r = http.post("/v1/chat/completions", json={"model": MODEL})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_unknown_model_route_and_method(http, schemas):
    for r in (
        http.post("/v1/chat/completions", json=chat_body(model="no-such-model")),
        http.get("/v1/models/no-such-model"),
        http.get("/v1/nothing-here"),
    ):
        assert r.status_code == 404
        schemas.validate("ErrorResponse", r.json())
    assert http.post("/v1/chat/completions", json=chat_body(model="nope")).json()["error"]["code"] == "model_not_found"
    r = http.delete("/v1/models")
    assert r.status_code == 405
    schemas.validate("ErrorResponse", r.json())


def test_auth(server, schemas):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        r = httpx.post(f"{server.url}/v1/chat/completions", json=chat_body(), headers=headers)
        assert r.status_code == 401
        schemas.validate("ErrorResponse", r.json())
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_sdk_error_classes(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=3)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=[{"role": "user", "content": "x"}])


# ---------------------------------------------------------------- metrics


def test_metrics_names(server, http):
    http.post("/v1/chat/completions", json=chat_body(max_tokens=2))
    text = httpx.get(f"{server.url}/metrics").text
    names = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "num_preemptions_total", "request_success_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "request_queue_time_seconds_bucket"):
        assert f"xinserve:{name}" in names, name
    assert "http_requests_total" in names
    success = metric_values(server, "xinserve:request_success_total")
    assert any(dict(k)["worker"] == "cpu" and dict(k)["model_name"] == MODEL and v > 0 for k, v in success.items())
    generated = metric_values(server, "xinserve:generation_tokens_total")
    assert generated[(("model_name", MODEL), ("worker", "cpu"))] > 0


# ---------------------------------------------------------------- load and disconnects


def test_64_concurrent_streams_match_offline(server, client):
    from xinserve.engines import LLM, SamplingParams

    prompts = [f"Story number {i}: the {['river', 'library', 'bread', 'harbour'][i % 4]}" for i in range(64)]
    max_tokens = [4 + i % 13 for i in range(64)]

    results = concurrent_greedy_chats(server.url, KEY, MODEL, prompts, max_tokens, timeout=300)

    llm = LLM(model=str(server.cache / MODEL), device="cpu")
    tok = llm.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                              tokenize=False), add_special_tokens=False) for p in prompts]
    offline = llm.generate(ids, [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens])
    for (text, usage, reason), ref in zip(results, offline):
        assert usage == len(ref.token_ids)
        assert reason == ref.finish_reason
        assert text == ref.text


def test_dropped_stream_frees_its_request(server):
    key = (("model_name", MODEL), ("worker", "cpu"))
    idle_kv = metric_values(server, "xinserve:kv_cache_usage_perc")[key]
    body = chat_body(max_tokens=1500, ignore_eos=True, stream=True)
    with (
        httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c,
        c.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data:")
            if seen == 5:
                # Still inside the loop: leaving it (or the block) drops the connection.
                assert metric_values(server, "xinserve:num_requests_running")[key] == 1
                assert metric_values(server, "xinserve:kv_cache_usage_perc")[key] > idle_kv
                break
    # The connection is closed: the worker must drop the request and give its KV blocks back.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        running = metric_values(server, "xinserve:num_requests_running")[key]
        kv = metric_values(server, "xinserve:kv_cache_usage_perc")[key]
        if running == 0 and kv == idle_kv:
            break
        time.sleep(0.2)
    assert running == 0
    assert kv == idle_kv
    generated = metric_values(server, "xinserve:generation_tokens_total")[key]
    time.sleep(0.5)
    assert metric_values(server, "xinserve:generation_tokens_total")[key] == generated  # it really stopped


def test_dropped_non_stream_request_is_aborted(server):
    key = (("model_name", MODEL), ("worker", "cpu"))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, timeout=1.0,
                   json=chat_body(max_tokens=2000, ignore_eos=True, n=4))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and metric_values(server, "xinserve:num_requests_running")[key] != 0:
        time.sleep(0.2)
    assert metric_values(server, "xinserve:num_requests_running")[key] == 0


def test_request_log_lines(server):
    log = server.log()
    line = next(ln for ln in log.splitlines() if "POST /v1/chat/completions status=200" in ln)
    for field in ("model=xinserve-tiny", "worker=cpu", "prompt_tokens=", "completion_tokens=", "latency="):
        assert field in line
    assert Path(server.cache).is_dir()


def test_bench_against_this_server(server):
    from xinserve.server.cli import bench

    parser = argparse.ArgumentParser()
    bench.add_args(parser)
    args = parser.parse_args(["--base-url", f"{server.url}/v1", "--api-key", KEY, "--num-prompts", "8",
                              "--concurrency", "4", "--output-tokens", "8", "--input-words", "6"])
    result = asyncio.run(bench.benchmark(args))
    (summary,) = result["runs"]
    assert summary["successful"] == 8 and summary["failed"] == 0
    assert summary["output_tokens"] == 64  # ignore_eos: exactly the tokens asked for
    assert result["model"] == MODEL
    assert 0 < summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p50"]
