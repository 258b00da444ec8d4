"""Prefill/decode disaggregation over Mooncake (engines/kv/mooncake_connector.py), two engines in one
process over loopback TCP: the decode engine reads the prefill engine's blocks and its greedy output is a
single engine's, computing only the last prompt token; a read that fails recomputes or fails as
``kv_load_failure_policy`` says, and no block stays held on either side."""

import socket
import sys
import time
from pathlib import Path

import pytest

from xinserve.engines import LLM, SamplingParams
from xinserve.engines.kv.block_layout import runs
from xinserve.engines.kv.mooncake_connector import transfer_engine
from xinserve.engines.kv.side_channel import TransferFailed, ask
from xinserve.engines.kv.transfer_config import KVTransferConfig

GREEDY = {"temperature": 0.0}
# Lengths around the 16-token block: the last prompt token alone in a block, at its end, in the middle.
PROMPTS = [list(range(3, 3 + n)) for n in (5, 16, 17, 32, 33, 40)]
ENGINE = {"num_kv_blocks": 32, "block_size": 16}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def transfer(role: str, **extra) -> dict:
    config = {"kv_connector": "MooncakeConnector", "kv_role": role, "kv_port": free_port()}
    return {**config, **extra}


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> str:
    return str(tiny_model_dir)


@pytest.fixture(scope="module")
def single(tiny: str) -> list[list[int]]:
    with LLM(tiny, **ENGINE) as llm:
        return [out.token_ids for out in llm.generate(PROMPTS, SamplingParams(max_tokens=8, **GREEDY))]


@pytest.fixture(scope="module")
def prefill(tiny: str):
    with LLM(tiny, **ENGINE, kv_transfer_config=transfer(
            "kv_producer", kv_connector_extra_config={"hold_timeout_s": 2.0})) as llm:
        yield llm


@pytest.fixture(scope="module")
def decode(tiny: str):
    with LLM(tiny, **ENGINE, kv_transfer_config=transfer(
            "kv_consumer", kv_connector_extra_config={"handshake_timeout_s": 1.0})) as llm:
        yield llm


def prefilled(prefill: LLM, prompts: list[list[int]]) -> list[dict]:
    """The proxy's first leg: max_tokens 1 with do_remote_decode; each answer's kv_transfer_params."""
    outs = prefill.generate(prompts, SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True},
                                                    **GREEDY))
    assert all(out.finish_reason == "length" for out in outs)
    return [out.kv_transfer_params for out in outs]


def settled(llm: LLM, timeout: float = 10.0) -> float:
    """The engine's KV usage once the blocks it held for readers are freed (or ``timeout`` passed)."""
    deadline = time.monotonic() + timeout
    while llm.engine.scheduler.held_blocks and time.monotonic() < deadline:
        llm.engine.release_sent_kv()
        time.sleep(0.05)
    return llm.engine.stats().kv_cache_usage


def test_the_decode_engine_reads_the_prompt_and_answers_as_one_engine(prefill: LLM, decode: LLM, single):
    params = prefilled(prefill, PROMPTS)
    assert params[0]["do_remote_prefill"] and params[0]["remote_port"] == prefill.engine.kv_connector.port
    before = decode.engine.stats()
    outs = decode.generate(PROMPTS, [SamplingParams(max_tokens=8, kv_transfer_params=p, **GREEDY) for p in params])
    after = decode.engine.stats()
    assert [out.token_ids for out in outs] == single
    # Every prompt token but the last was read, none computed.
    assert after.prompt_tokens_computed_total - before.prompt_tokens_computed_total == len(PROMPTS)
    assert after.external_prefix_cache_hits_total - before.external_prefix_cache_hits_total == sum(
        len(p) - 1 for p in PROMPTS)
    assert settled(prefill) == 0.0 and decode.engine.stats().kv_cache_usage == 0.0


def test_what_is_read_is_the_prefill_engines_kv(prefill: LLM, decode: LLM, single):
    prompt = PROMPTS[-1]
    (params,) = prefilled(prefill, [prompt])
    prefill.engine.runner.kv_cache.normal_()  # the held blocks are garbage now
    out = decode.generate([prompt], SamplingParams(max_tokens=8, kv_transfer_params=params, **GREEDY))[0]
    assert out.token_ids != single[-1]
    prefill.engine.reset_prefix_cache()  # the garbage must not serve a later prefix hit
    settled(prefill)


@pytest.mark.parametrize("fault", ["block ids", "request id", "unreachable"])
def test_a_failed_read_is_recomputed_to_the_same_output(prefill: LLM, decode: LLM, single, fault: str):
    prompt = PROMPTS[2]
    (params,) = prefilled(prefill, [prompt])
    bad = dict(params)
    if fault == "block ids":
        bad["remote_block_ids"] = [b + 1 for b in params["remote_block_ids"]]
    elif fault == "request id":
        bad["remote_request_id"] = "no-such-request"
    else:
        bad["remote_port"] = free_port()  # nobody listens: the side channel never answers
    decode.engine.reset_prefix_cache()  # so that the whole prompt is recomputed
    before = decode.engine.stats()
    out = decode.generate([prompt], SamplingParams(max_tokens=8, kv_transfer_params=bad, **GREEDY))[0]
    after = decode.engine.stats()
    assert out.error is None and out.token_ids == single[2]
    assert after.prompt_tokens_computed_total - before.prompt_tokens_computed_total == len(prompt)
    assert after.kv_cache_usage == 0.0
    # Never read: the prefill engine frees the blocks when its hold expires (hold_timeout_s 2).
    assert prefill.engine.scheduler.held_blocks
    assert settled(prefill) == 0.0 and prefill.engine.kv_connector.held.expired_total >= 1


def test_with_the_fail_policy_a_failed_read_fails_the_request(tiny: str, prefill: LLM):
    (params,) = prefilled(prefill, [PROMPTS[1]])
    config = transfer("kv_consumer", kv_load_failure_policy="fail")
    with LLM(tiny, **ENGINE, kv_transfer_config=config) as decode:
        bad = {**params, "remote_request_id": "no-such-request"}
        out = decode.generate([PROMPTS[1]], SamplingParams(max_tokens=8, kv_transfer_params=bad, **GREEDY))[0]
        assert out.error is not None and "could not be loaded" in out.error
        assert out.finish_reason == "abort" and decode.engine.stats().kv_cache_usage == 0.0
        # The good params still work on this engine.
        ok = decode.generate([PROMPTS[1]], SamplingParams(max_tokens=4, kv_transfer_params=params, **GREEDY))[0]
        assert ok.error is None
    assert settled(prefill) == 0.0


def test_a_prefill_that_stops_on_its_first_token_hands_nothing_over(prefill: LLM):
    first = prefill.generate([PROMPTS[0]], SamplingParams(max_tokens=1, **GREEDY))[0].token_ids[0]
    out = prefill.generate([PROMPTS[0]], SamplingParams(
        max_tokens=1, stop_token_ids=[first], kv_transfer_params={"do_remote_decode": True}, **GREEDY))[0]
    assert out.finish_reason == "stop" and out.kv_transfer_params is None
    assert not prefill.engine.scheduler.held_blocks


@pytest.mark.parametrize(("params", "message"), [
    ({"do_remote_prefill": True}, "remote_engine_id must be a str"),
    ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [-1], "remote_host": "h",
      "remote_port": 1, "remote_request_id": "r"}, "non-negative integers"),
    ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [0], "remote_host": "h",
      "remote_port": 70000, "remote_request_id": "r"}, "remote_port must be a TCP port"),
    ({"do_remote_decode": True}, "this instance is a kv_consumer"),
])
def test_bad_transfer_params_are_refused_before_they_run(decode: LLM, params: dict, message: str):
    with pytest.raises(ValueError, match=message):
        decode.engine.add_request("bad", PROMPTS[0], SamplingParams(kv_transfer_params=params))


@pytest.mark.parametrize("address", ["tcp://no such host:1", "tcp://127.0.0.1:99999"])
def test_a_side_channel_address_no_socket_can_use_is_a_failed_transfer(address: str):
    """Hosts and ports come from requests: one ZeroMQ cannot connect to fails the transfer (recompute or
    fail, per policy), it never escapes as a ZMQError."""
    with pytest.raises(TransferFailed):  # at connect (no such host) or as no answer (port 99999)
        ask(address, {"op": "lookup", "room": 1}, 1.0)


def test_transfer_params_need_a_connector(tiny: str):
    with LLM(tiny, **ENGINE) as llm, pytest.raises(ValueError, match="kv_transfer_config"):
        llm.engine.add_request("r", PROMPTS[0], SamplingParams(kv_transfer_params={"do_remote_decode": True}))


@pytest.mark.parametrize(("config", "message"), [
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, "kv_connector must be one of MooncakeConnector"),
    ({"kv_connector": "MooncakeConnector", "kv_role": "prefill"}, "kv_role must be one of"),
    ({"kv_connector": "MooncakeConnector", "kv_role": "kv_both", "kv_load_failure_policy": "retry"}, "recompute, fail"),
    ({"kv_connector": "MooncakeConnector", "kv_role": "kv_both", "kv_porta": 1}, "unknown field"),
    ({"kv_connector": "MooncakeConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"hold_timeout_s": 0}}, "hold_timeout_s"),
])
def test_the_config_is_checked_as_vllm_spells_it(config: dict, message: str):
    with pytest.raises(ValueError, match=message):
        KVTransferConfig.parse(config)


@pytest.mark.parametrize(("kind", "package"), [("cpu", "mooncake-transfer-engine-non-cuda"),
                                               ("cuda", "mooncake-transfer-engine-cuda13"),
                                               ("musa", "mooncake-transfer-engine-non-cuda"),
                                               ("npu", "mooncake-transfer-engine-npu")])
def test_a_missing_transfer_engine_is_refused_with_what_to_install(monkeypatch, kind: str, package: str):
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # import fails
    with pytest.raises(RuntimeError, match=f"MooncakeConnector needs Mooncake's transfer engine.*{package}"):
        transfer_engine(kind, "127.0.0.1", "tcp", "")


def test_consecutive_blocks_on_both_sides_are_read_as_one_range():
    assert runs([4, 5, 6, 9], [0, 1, 2, 3]) == [(0, 3), (3, 4)]
    assert runs([1, 2], [7, 9]) == [(0, 1), (1, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])  # experts; latent attention (MLA) with experts
def test_moe_and_mla_models_disaggregated_answer_as_one_engine(tiny_models, arch: str):
    path = str(tiny_models(arch))
    sampling = SamplingParams(max_tokens=8, **GREEDY)
    with LLM(path, **ENGINE) as llm:
        want = [out.token_ids for out in llm.generate(PROMPTS, sampling)]
    with (LLM(path, **ENGINE, kv_transfer_config=transfer("kv_producer")) as producer,
          LLM(path, **ENGINE, kv_transfer_config=transfer("kv_consumer")) as consumer):
        params = prefilled(producer, PROMPTS)
        before = consumer.engine.stats().prompt_tokens_computed_total
        outs = consumer.generate(PROMPTS, [SamplingParams(max_tokens=8, kv_transfer_params=p, **GREEDY)
                                           for p in params])
        assert [out.token_ids for out in outs] == want
        assert consumer.engine.stats().prompt_tokens_computed_total - before == len(PROMPTS)
        assert settled(producer) == 0.0 and consumer.engine.stats().kv_cache_usage == 0.0
