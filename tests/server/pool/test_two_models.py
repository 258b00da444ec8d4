"""A fleet config with two models, one the other's fallback, and a third whose worker cannot load.

Pins the start-up defects: both models serve (their tokenizers once raced in two threads), a model
whose weights and tokenizer sit in separate directories loads in the worker too, one and two
sequences per worker start, a worker that fails to load exits. Then, on the trained stories260K,
the text-level defects: log-prob tokens keep their leading space, a stop token's text is left out,
stop strings wait for min_tokens, a vanishing temperature is greedy, one bad request fails alone,
and clients may repeat an X-Request-Id.
"""

import asyncio
import json
import shutil
import time
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from tests.server.conftest import serve_config

# Greedy stories260K after "Once upon a time" (checked against transformers in tests/engines).
STORY = ", there was a little girl named Lily. She loved to play outside in the park."
PROMPT = "Once upon a time"


def split_checkpoint(source: Path, root: Path) -> tuple[Path, Path]:
    weights, tokenizer = root / "weights", root / "tokenizer"
    weights.mkdir()
    tokenizer.mkdir()
    for f in source.iterdir():
        is_tokenizer = f.name.startswith(("tokenizer", "special_tokens"))
        shutil.copy(f, (tokenizer if is_tokenizer else weights) / f.name)
    return weights, tokenizer


@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir, stories_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    weights, tokenizer = split_checkpoint(stories_dir, root)
    bad = root / "badarch"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["FancyForCausalLM"], "model_type": "llama"}))
    config = {"models": [
        {"name": "stories", "path": str(weights), "tokenizer": str(tokenizer), "workers": ["cpu"],
         "max_num_seqs": 2, "cpu_threads": 1},
        {"name": "tiny", "path": str(tiny_model_dir), "workers": ["cpu"], "max_num_seqs": 1,
         "cpu_threads": 1, "fallback": ["stories"]},
        {"name": "badarch", "path": str(bad), "tokenizer": str(tokenizer), "workers": ["cpu"],
         "fallback": ["tiny"]},
    ]}
    srv = serve_config(start_server, root, config, settle="settled")
    yield srv
    srv.stop()


def workers(http) -> dict[str, dict]:
    return {w["model"]: w for w in http.get("/health").json()["workers"]}


def complete(http, **kw) -> dict:
    r = http.post("/v1/completions", json={"model": "stories", "prompt": PROMPT, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_both_models_serve_and_the_broken_one_falls_back(http):
    states = {name: w["state"] for name, w in workers(http).items()}
    assert states == {"stories": "ready", "tiny": "ready", "badarch": "failed"}
    for model in ("stories", "tiny"):
        r = http.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["model"] == model
    r = http.post("/v1/completions", json={"model": "badarch", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "tiny"


def test_a_worker_that_fails_to_load_exits(http):
    bad = workers(http)["badarch"]
    assert "FancyForCausalLM" in bad["last_error"]
    status = Path(f"/proc/{bad['pid']}/status")
    deadline = time.monotonic() + 20
    while status.exists() and "zombie" not in status.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not status.exists() or "zombie" in status.read_text()


def test_logprob_tokens_keep_their_leading_space(http):
    out = complete(http, max_tokens=6, logprobs=2)["choices"][0]
    lp = out["logprobs"]
    assert lp["tokens"] == [",", " there", " was", " a", " little", " g"]
    assert "".join(lp["tokens"]) == out["text"] == ", there was a little g"
    assert lp["text_offset"] == [0, 1, 7, 11, 13, 20]
    assert " there" in lp["top_logprobs"][1]  # the alternatives are decoded the same way
    chat = http.post("/v1/chat/completions", json={
        "model": "stories", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6,
        "temperature": 0, "logprobs": True, "top_logprobs": 2}).json()["choices"][0]
    tokens = [t["token"] for t in chat["logprobs"]["content"]]
    assert "".join(tokens) == chat["message"]["content"]
    assert any(t.startswith(" ") for t in tokens)


def test_echoed_prompt_offsets_index_the_echo(http):
    out = complete(http, max_tokens=3, logprobs=1, echo=True)["choices"][0]
    lp = out["logprobs"]
    assert out["text"].startswith(PROMPT) and lp["tokens"][:5] == ["<s>", " Once", " upon", " a", " time"]
    assert lp["text_offset"] == [0, 0, 4, 9, 11, 16, 17, 23]  # the prompt's were all 0
    body = {"model": "stories", "prompt": PROMPT, "temperature": 0, "max_tokens": 3, "logprobs": 1,
            "echo": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        first = json.loads(next(line for line in r.iter_lines() if line.startswith("data: "))[6:])
    assert first["choices"][0]["logprobs"]["text_offset"][:5] == [0, 0, 4, 9, 11]


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_is_left_out_unless_asked(http, include):
    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[2] / "fixtures" / "stories260K")
    lily = tokenizer.encode(" Lily", add_special_tokens=False)[-1]
    out = complete(http, max_tokens=20, stop_token_ids=[lily], skip_special_tokens=False,
                   include_stop_str_in_output=include)["choices"][0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == ", there was a little girl named" + (" Lily" if include else "")


def test_stop_strings_wait_for_min_tokens(http):
    assert complete(http, max_tokens=30, stop=["."])["choices"][0]["text"] == ", there was a little girl named Lily"
    # "." is the 11th token: with min_tokens 12 the first full stop does not count.
    late = complete(http, max_tokens=30, stop=["."], min_tokens=12)["choices"][0]
    assert late["text"] == STORY[:-1] and late["finish_reason"] == "stop"


def test_vanishing_temperature_is_greedy(http):
    greedy = complete(http, max_tokens=20)["choices"][0]["text"]
    assert greedy.startswith(", there was a little girl")
    assert complete(http, max_tokens=20, temperature=1e-40)["choices"][0]["text"] == greedy


def test_out_of_range_stop_token_ids_fail_alone(server, http):
    solo = complete(http, max_tokens=40, ignore_eos=True)["choices"][0]["text"]

    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            async def stream() -> str:
                text = ""
                body = {"model": "stories", "prompt": PROMPT, "temperature": 0, "max_tokens": 40,
                        "ignore_eos": True, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            text += json.loads(line[6:])["choices"][0]["text"]
                return text

            task = asyncio.create_task(stream())
            await asyncio.sleep(0.3)
            bad = await client.post("/v1/completions", json={
                "model": "stories", "prompt": PROMPT, "max_tokens": 5, "stop_token_ids": [10**6],
                "min_tokens": 3})
            return bad, await task

    bad, streamed = asyncio.run(go())
    assert bad.status_code == 400 and "stop_token_ids" in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] == "stop_token_ids"
    assert streamed == solo


def test_repeated_x_request_id_is_fine(server, http):
    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            body = {"model": "stories", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
            return await asyncio.gather(*(client.post("/v1/completions", json=body,
                                                      headers={"X-Request-Id": "same-id"}) for _ in range(3)))

    responses = asyncio.run(go())
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert all(r.headers["x-request-id"] == "same-id" for r in responses)
    assert len({r.json()["id"] for r in responses}) == 3
    assert workers(http)["stories"]["load"] == 0
