"""1P1D through the vLLM-protocol proxy and behind sglang-router's PD mode, for the other attention and FFN
families: a mixture-of-experts model (Qwen3-MoE) and a latent-attention model with experts and the DSA indexer (GLM-5's architecture). Greedy
answers equal one server's for 20 prompts, the decode server computes only each prompt's last token, and no
KV block stays used on either side (the dense model's run, with streams, n > 1, stop strings and log-probs,
is test_pd_proxy.py)."""

from pathlib import Path

import pytest

from tests.server.disagg.pd_servers import check_twenty_prompts, pd_server, sglang_gateway, vllm_proxy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["qwen3_moe", "glm_moe_dsa"])
def pd_pair(request, start_server, tiny_models, tmp_path_factory):
    """(prefill server, decode server, proxy URL) serving one tiny model of the family."""
    path: Path = tiny_models(request.param)
    prefill = pd_server(start_server, path, tmp_path_factory, "kv_producer", hold_timeout_s=5)
    decode = pd_server(start_server, path, tmp_path_factory, "kv_consumer", handshake_timeout_s=2)
    with vllm_proxy(prefill.url, decode.url, tmp_path_factory.mktemp("proxy")) as url:
        yield prefill, decode, url


def test_twenty_prompts_of_moe_and_mla_models_answer_as_one_server(pd_pair):
    check_twenty_prompts(*pd_pair)


def test_twenty_prompts_of_moe_and_mla_models_behind_sglang_router_answer_as_one_server(pd_pair, tmp_path_factory):
    prefill, decode, _ = pd_pair
    with sglang_gateway(prefill, decode, tmp_path_factory.mktemp("router")) as url:
        check_twenty_prompts(prefill, decode, url)
