"""lm-eval's text mode against its ``hf`` backend on the same weights (issue 38, item 9).

``local-completions`` with ``tokenized_requests=False`` finds ``GET /tokenizer_info``, tokenises with
``/tokenize`` (no special tokens), turns each request's ids back into text with ``/detokenize``, sends
the text with ``echo`` and ``logprobs`` and sums the echoed log-probs from its own context length on.
Its ``hf`` backend scores the same ids with BOS in front, as the tokenizer adds it.

Since /tokenize without special tokens counts no BOS but the completion adds one, lm-eval's slice
starts one token early: a question with a context scores its context's last token too, the same
log-prob for every choice (lm-eval's known quirk, vLLM's too). An empty context is BOS itself, sent as
the text ``<s>…``: that must score exactly as the ``hf`` backend does.
"""

import httpx
import pytest
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.models.openai_completions import LocalCompletionsAPI

pytestmark = pytest.mark.slow

MODEL = "stories"
# A small multiple-choice task as lm-eval poses it: (context, choices), each choice after the
# target delimiter " ". An empty context is scored after BOS alone (sentence-plausibility tasks).
QUESTIONS = [
    ("Once upon a time, there was a little girl named", ["Lily", "Tim", "Sue", "the"]),
    ("Mom went to the", ["park.", "store", "big tree"]),
    ("Tom had a red", ["ball.", "car", "dog"]),
    ("The sun was", ["shining.", "sad", "very big"]),
    ("She saw a", ["bird", "cat.", "big box"]),
    ("", ["Lily went out.", "The dog ran.", "Mom was happy."]),
    ("", ["Once upon a time", "Tim liked cake.", "It was a sunny day."]),
    ("", ["Ben and Sue played.", "They had fun.", "The end."]),
    ("", ["A big fish swam.", "Sam was sad."]),
    ("", ["One day, a bird sang.", "The car was red.", "He said hi."]),
]
TOLERANCE = 1e-3  # nats: the server's float32 forward against transformers'


@pytest.fixture(scope="module")
def server(start_server, stories_dir):
    srv = start_server(["--model", str(stories_dir), "--served-model-name", MODEL, "--max-num-seqs", "1"])
    srv.wait_ready()
    return srv


def loglikelihoods(lm, pairs: list[tuple[str, str]]) -> list[float]:
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    return [ll for ll, _greedy in lm.loglikelihood(requests, disable_tqdm=True)]


def last_token_logprob(url: str, context: str) -> float:
    """The server's log-prob of the context's last token (lm-eval's one-token-early slice)."""
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": context, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["token_logprobs"][-2]


def test_text_mode_scores_every_choice_as_the_hf_backend_does(server, stories_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    api = LocalCompletionsAPI(base_url=f"{server.url}/v1/completions", model=MODEL, tokenized_requests=False,
                              max_length=512)
    assert api.tokenizer_backend == "remote"  # it found /tokenizer_info and /tokenize
    hf = HFLM(pretrained=str(stories_dir), device="cpu", batch_size=1)
    pairs = [(context, f" {choice}") for context, choices in QUESTIONS for choice in choices]
    served, reference = loglikelihoods(api, pairs), loglikelihoods(hf, pairs)
    for (context, choice), got, want in zip(pairs, served, reference, strict=True):
        quirk = last_token_logprob(server.url, context) if context else 0.0
        assert got - quirk == pytest.approx(want, abs=TOLERANCE), (context, choice, got, want, quirk)


def test_tokenizer_info_names_the_hugging_face_class(server):
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    # transformers 5 calls this class TokenizersBackend; the tokenizer's config, transformers 4 and
    # vLLM name it PreTrainedTokenizerFast (an alias that transformers 5 still resolves).
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (info["bos_token"], info["eos_token"]) == ("<s>", "</s>")
