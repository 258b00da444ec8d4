"""The pooling endpoints through a real server: one embedding model (Matryoshka 16/32), one sequence
classifier, one Qwen3-Reranker-shaped causal LM (convert classify, scored by its "no"/"yes" tokens) and
one generating model, against sentence-transformers and transformers; OpenAI's SDK; hostile inputs."""

import base64
import warnings

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from tests.engines.pooling.model_dirs import make_classifier, make_embedding_model, make_reranker
from tests.server.conftest import serve_config, wait_for

pytestmark = pytest.mark.slow  # a server of four models (one CPU worker each)

KEY = "sk-pooling-all-5c1e"
EMBED_ONLY_KEY = "sk-pooling-embed-77a0"  # limited to the model "embed"
TEXTS = ["hello world", "the harbour fog rolled slowly over the boats", "a", "bread and salt " * 5]
QUERY = "what do you bake bread with"


@pytest.fixture(scope="module")
def server(start_server, tiny_models, tmp_path_factory):
    directory = tmp_path_factory.mktemp("pooling-server")
    one = {"workers": ["cpu"], "cpu_threads": 1, "num_kv_blocks": 16, "block_size": 8}
    config = {
        "server": {"api_keys": [KEY, {"name": "embed-only", "key": EMBED_ONLY_KEY, "models": ["embed"]}]},
        "models": [
            {"name": "embed", "path": str(make_embedding_model(directory / "embed", matryoshka=[16, 32])), **one},
            {"name": "classifier", "path": str(make_classifier(directory / "classifier")), **one},
            {"name": "reranker", "path": str(make_reranker(directory / "reranker")), "runner": "pooling",
             "convert": "classify", "classifier_from_token": "no,yes", **one},
            {"name": "tiny", "path": str(tiny_models("qwen3")), **one},
        ],
    }
    srv = serve_config(start_server, directory, config)
    srv.dirs = {model["name"]: model["path"] for model in config["models"]}
    return srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


def _st_embeddings(path: str, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SentenceTransformer(path, device="cpu").encode(texts, convert_to_numpy=True)


def _p_yes(path: str, pairs: list[tuple[str, str]]) -> list[float]:
    """Qwen3-Reranker's score in transformers: P(yes) over the "no"/"yes" logits of the last token."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    scores = []
    for query, document in pairs:
        ids = torch.tensor([tokenizer(query, text_pair=document)["input_ids"]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, -1]
        scores.append(logits[[no, yes]].softmax(-1)[1].item())
    return scores


def test_openai_sdk_embeddings_float_base64_and_dimensions(server):
    import openai

    expected = _st_embeddings(server.dirs["embed"], TEXTS)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    floats = client.embeddings.create(model="embed", input=TEXTS, encoding_format="float")
    got = np.array([d.embedding for d in floats.data])
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    assert np.abs(got - expected).max() < 1e-5
    tokenizer = AutoTokenizer.from_pretrained(server.dirs["embed"])
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)
    # Without encoding_format the SDK asks for base64 and decodes it itself; asked for, it hands the text over.
    default = client.embeddings.create(model="embed", input=TEXTS)
    assert np.abs(np.array([d.embedding for d in default.data]) - expected).max() < 1e-5
    packed = client.embeddings.create(model="embed", input=TEXTS, encoding_format="base64")
    decoded = np.array([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in packed.data])
    assert np.abs(decoded - expected).max() < 1e-5
    short = client.embeddings.create(model="embed", input=TEXTS[1], dimensions=16)
    truncated = expected[1, :16] / np.linalg.norm(expected[1, :16])
    assert np.abs(np.array(short.data[0].embedding) - truncated).max() < 1e-5


def test_token_id_inputs_and_the_pooling_route(http, server):
    tokenizer = AutoTokenizer.from_pretrained(server.dirs["embed"])
    ids = [tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    expected = _st_embeddings(server.dirs["embed"], TEXTS[:2])
    one = http.post("/v1/embeddings", json={"model": "embed", "input": ids[0]}).json()
    assert np.abs(np.array(one["data"][0]["embedding"]) - expected[0]).max() < 1e-5
    body = http.post("/pooling", json={"model": "embed", "input": ids, "encoding_format": "base64"}).json()
    assert body["object"] == "list" and [d["object"] for d in body["data"]] == ["pooling", "pooling"]
    decoded = np.array([np.frombuffer(base64.b64decode(d["data"]), dtype="<f4") for d in body["data"]])
    assert np.abs(decoded - expected).max() < 1e-5


def test_classify_equals_transformers(http, server):
    model = AutoModelForSequenceClassification.from_pretrained(server.dirs["classifier"], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(server.dirs["classifier"])
    body = http.post("/classify", json={"model": "classifier", "input": TEXTS}).json()
    for item, text in zip(body["data"], TEXTS):
        with torch.no_grad():
            probs = model(**tokenizer(text, return_tensors="pt")).logits[0].softmax(-1)
        assert np.abs(np.array(item["probs"]) - probs.numpy()).max() < 1e-5
        assert item["label"] == model.config.id2label[int(probs.argmax())] and item["num_classes"] == 3


def test_score_and_rerank_equal_transformers_p_yes(http, server):
    expected = _p_yes(server.dirs["reranker"], [(QUERY, t) for t in TEXTS])
    score = http.post("/score", json={"model": "reranker", "text_1": QUERY, "text_2": TEXTS}).json()
    assert np.abs(np.array([d["score"] for d in score["data"]]) - expected).max() < 1e-5
    alias = http.post("/v1/score", json={"model": "reranker", "queries": [QUERY], "documents": TEXTS}).json()
    assert np.abs(np.array([d["score"] for d in alias["data"]]) - expected).max() < 1e-5
    order = sorted(range(len(TEXTS)), key=lambda i: expected[i], reverse=True)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = http.post(path, json={"model": "reranker", "query": QUERY, "documents": TEXTS, "top_n": 2}).json()
        assert [r["index"] for r in body["results"]] == order[:2]
        assert [r["document"]["text"] for r in body["results"]] == [TEXTS[i] for i in order[:2]]
        assert np.abs(np.array([r["relevance_score"] for r in body["results"]]) - [expected[i] for i in order[:2]]).max() < 1e-5
    bare = http.post("/rerank", json={"model": "reranker", "query": QUERY, "documents": [{"text": TEXTS[0]}],
                                      "return_documents": False}).json()
    assert bare["results"] == [{"index": 0, "relevance_score": pytest.approx(expected[0], abs=1e-5)}]


def test_score_with_an_embedding_model_is_cosine_similarity(http, server):
    vectors = _st_embeddings(server.dirs["embed"], [QUERY, TEXTS[0]])
    body = http.post("/score", json={"model": "embed", "text_1": QUERY, "text_2": [TEXTS[0]]}).json()
    assert body["data"][0]["score"] == pytest.approx(float(vectors[0] @ vectors[1]), abs=1e-5)


@pytest.mark.parametrize(("path", "body", "status", "needle"), [
    ("/v1/embeddings", {"model": "embed", "input": ""}, 400, "is empty"),
    ("/v1/embeddings", {"model": "embed", "input": []}, 400, "must not be empty"),
    ("/v1/embeddings", {"model": "embed", "input": ["x"] * 10_000}, 400, "at most 2048"),
    ("/v1/embeddings", {"model": "embed", "input": "bread " * 200}, 400, "maximum context length is 128 tokens"),
    ("/v1/embeddings", {"model": "embed", "input": [[5, 100_000]]}, 400, "outside the vocabulary"),
    ("/v1/embeddings", {"model": "embed", "input": "x", "dimensions": 24}, 400, "supports dimensions [16, 32]"),
    ("/v1/embeddings", {"model": "embed", "input": "x", "truncate_prompt_tokens": 500}, 400, "truncate_prompt_tokens"),
    ("/v1/embeddings", {"model": "reranker", "input": "x"}, 400, "does not support the Embeddings API"),
    ("/v1/embeddings", {"model": "tiny", "input": "x"}, 400, "served for generation"),
    ("/v1/embeddings", {"model": "nope", "input": "x"}, 404, "does not exist"),
    ("/classify", {"model": "embed", "input": "x"}, 400, "does not support the Classification API"),
    ("/score", {"model": "classifier", "text_1": "a", "text_2": "b"}, 400, "this classifier has 3 labels"),
    ("/score", {"model": "reranker", "text_1": ["a", "b"], "text_2": ["c"]}, 400, "give one text_1"),
    ("/rerank", {"model": "reranker", "query": "a", "documents": []}, 400, "must not be empty"),
    ("/v1/chat/completions", {"model": "embed", "messages": [{"role": "user", "content": "hi"}]}, 400,
     "served for pooling (embed), not generation"),
])
def test_hostile_inputs_are_openai_4xx(http, path, body, status, needle):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"] and set(error) == {"message", "type", "param", "code"}


def test_more_inputs_than_a_worker_holds_requests_in_one_request(http):
    # 400 inputs: more than max_num_seqs + max_waiting_requests (64 + 256), fewer than max_pooling_inputs
    r = http.post("/v1/embeddings", json={"model": "embed", "input": [f"word {i}" for i in range(400)]})
    assert r.status_code == 200, r.text
    assert [d["index"] for d in r.json()["data"]] == list(range(400))


def test_long_input_truncated_and_the_workers_live_on(http, server):
    r = http.post("/v1/embeddings", json={"model": "embed", "input": "bread " * 200, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 128
    ok = http.post("/v1/embeddings", json={"model": "embed", "input": TEXTS[0]})
    assert ok.status_code == 200

    def idle() -> dict | None:  # every request done, every KV block free again, no worker restarted
        health = http.get("/health").json()
        workers = health["workers"]
        settled = all(w["num_requests_running"] == w["num_requests_waiting"] == 0 and w["kv_cache_usage"] == 0
                      for w in workers)
        return health if settled and health["status"] == "ok" and all(w["restarts"] == 0 for w in workers) else None

    assert wait_for(idle, timeout=10), http.get("/health").json()


def test_keys_scope_the_pooling_models(server):
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {EMBED_ONLY_KEY}"}) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["embed"]
        assert c.post("/v1/embeddings", json={"model": "embed", "input": "x"}).status_code == 200
        assert c.post("/rerank", json={"model": "reranker", "query": "a", "documents": ["b"]}).status_code == 404
    assert httpx.post(f"{server.url}/v1/embeddings", json={"model": "embed", "input": "x"}).status_code == 401


def test_models_lists_the_pooling_models(http):
    ids = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert ids == ["embed", "classifier", "reranker", "tiny"]
