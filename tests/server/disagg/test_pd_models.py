"""1P1D through the vLLM-protocol proxy for the other attention and FFN families: a mixture-of-experts model
(Qwen3-MoE) and a latent-attention model with experts and the DSA indexer (GLM-5's architecture). Greedy
answers equal one server's for 20 prompts, the decode server computes only each prompt's last token, and no
KV block stays used on either side (the dense model's run, with streams, n > 1, stop strings and log-probs,
is test_pd_proxy.py)."""

from pathlib import Path

import pytest

from tests.server.conftest import serve_config
from tests.server.disagg.pd_servers import PROMPTS, completion, kv_settles, metric, model_config, vllm_proxy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["qwen3_moe", "glm_moe_dsa"])
def pd_pair(request, start_server, tiny_models, tmp_path_factory):
    """(prefill server, decode server, proxy URL) serving one tiny model of the family."""
    path: Path = tiny_models(request.param)
    prefill = serve_config(start_server, tmp_path_factory.mktemp("prefill"),
                           model_config(path, "kv_producer", kv_connector_extra_config={"hold_timeout_s": 5}))
    decode = serve_config(start_server, tmp_path_factory.mktemp("decode"),
                          model_config(path, "kv_consumer", kv_connector_extra_config={"handshake_timeout_s": 2}))
    with vllm_proxy(prefill.url, decode.url, tmp_path_factory.mktemp("proxy")) as url:
        yield prefill, decode, url


def test_twenty_prompts_of_moe_and_mla_models_answer_as_one_server(pd_pair):
    prefill, decode, proxy = pd_pair
    single = [completion(prefill.url, p)["choices"][0] for p in PROMPTS]  # the prefill server alone
    computed = metric(decode, "prompt_tokens_computed_total")
    via_proxy = [completion(proxy, p)["choices"][0] for p in PROMPTS]
    assert [(c["text"], c["finish_reason"]) for c in via_proxy] == [(c["text"], c["finish_reason"]) for c in single]
    assert metric(decode, "prompt_tokens_computed_total") - computed == len(PROMPTS)  # each prompt's last token
    assert kv_settles(prefill) == 0 and kv_settles(decode) == 0
