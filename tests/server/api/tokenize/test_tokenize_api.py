"""vLLM's tokenizer endpoints against the Hugging Face tokenizer of the served model."""

import httpx
import pytest
import transformers
from transformers import AutoTokenizer

from tests.server.thinking_model import KEYS

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The river <think> café"}]


@pytest.fixture(scope="module")
def http(thinking_server):
    with httpx.Client(base_url=thinking_server.url, timeout=60, headers={"Authorization": f"Bearer {KEYS[0]}"}) as c:
        yield c


@pytest.fixture(scope="module")
def hf(thinking_server):
    return AutoTokenizer.from_pretrained(thinking_server.model_dir)


def test_tokenize_a_prompt_equals_the_hf_tokenizer(http, hf):
    text = "The river </think> meets the sea, naïvely."
    r = http.post("/tokenize", json={"model": "thinker", "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == hf.encode(text) and body["count"] == len(body["tokens"])
    assert body["token_strs"] == hf.convert_ids_to_tokens(body["tokens"]) and body["max_model_len"] == 512
    plain = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()  # model optional
    assert plain["tokens"] == hf.encode(text, add_special_tokens=False)


def test_tokenize_messages_equals_the_chat_template(http, hf):
    body = http.post("/tokenize", json={"model": "thinker", "messages": MESSAGES,
                                        "chat_template_kwargs": {"enable_thinking": False}}).json()
    text = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert body["tokens"] == hf.encode(text, add_special_tokens=False)
    # ... the very prompt a chat completion counts
    chat = http.post("/v1/chat/completions", json={"model": "thinker", "messages": MESSAGES, "max_tokens": 1,
                                                   "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert chat["usage"]["prompt_tokens"] == body["count"]


def test_detokenize_round_trips(http, hf):
    ids = hf.encode("Good software is tested.", add_special_tokens=False)
    assert http.post("/detokenize", json={"model": "thinker", "tokens": ids}).json() == {"prompt": hf.decode(ids)}


def test_tokenizer_info(http, hf):
    info = http.get("/tokenizer_info").json()
    # the class's name as transformers 4 and vLLM give it: under transformers 5 an alias of type(hf)
    assert getattr(transformers, info["tokenizer_class"]) is type(hf) and info["chat_template"] == hf.chat_template
    assert info["tokenizer_class"] != "TokenizersBackend"
    assert info["eos_token"] == hf.eos_token and info["model_max_length"] == hf.model_max_length


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"model": "thinker"}, 400, "prompt"),
    ("/tokenize", {"model": "thinker", "prompt": "x" * 1_000_001}, 400, "prompt"),
    ("/tokenize", {"model": "thinker", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    # a request may not bring its own template here either (issue 18's template refusal)
    ("/tokenize", {"model": "thinker", "messages": [{"role": "user", "content": "x"}],
                   "chat_template_kwargs": {"chat_template": "{{ 'ab ' * 2000000 }}"}}, 400,
     "chat_template_kwargs.chat_template"),
    ("/detokenize", {"model": "thinker", "tokens": [5, 10**9]}, 400, "tokens"),
    ("/detokenize", {"model": "thinker", "tokens": [-1]}, 400, "tokens"),
])
def test_bad_requests_get_the_error_envelope(http, path, body, status, param):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_needs_a_key(thinking_server):
    assert httpx.post(f"{thinking_server.url}/tokenize", json={"prompt": "x"}).status_code == 401
