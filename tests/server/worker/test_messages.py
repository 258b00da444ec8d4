"""The messages between the HTTP process and a worker: typed both ways, compact on the wire."""

from dataclasses import fields

import msgspec
import pytest

from xinserve.engines.core.outputs import EngineStats, StepOutput, TokenLogprob
from xinserve.engines.core.sampling_params import DETOKENIZER_FIELDS, SamplingParams
from xinserve.engines.pooling.params import PoolingParams
from xinserve.server.worker import messages
from xinserve.server.worker.messages import (
    Abort,
    Failed,
    LoadFailed,
    Outputs,
    Ready,
    RequestError,
    Shutdown,
    Stats,
)

STATS = EngineStats(1, 2, 0.5, 3, 4, 5, 6, 7)


def test_a_step_is_positional_arrays_without_field_names():
    frame = messages.encode(Outputs([StepOutput("r", 0, [5]), StepOutput("s", 1, [6], True, "length")]))
    kind, outputs, stats, queue_times = msgspec.msgpack.decode(frame)
    assert (kind, stats, queue_times) == ("out", None, {})
    assert [o[:5] for o in outputs] == [["r", 0, [5], False, None], ["s", 1, [6], True, "length"]]
    assert len(frame) < 40


@pytest.mark.parametrize("message", [
    Ready({"max_model_len": 64, "ranks": [{"rank": 0}]}),
    LoadFailed("OSError: no such file"),
    Outputs([StepOutput("r", 0, [5], logprobs=[TokenLogprob(-0.5, [5, 7], [-0.5, -1.5])],
                        prompt_logprobs=[None, TokenLogprob(-2.0, [], [])])], STATS, {"r": 0.25}),
    Failed("r", RequestError("the schema took too long", client_fault=True)),
    Stats(STATS),
])
def test_what_a_worker_sends_comes_back_as_it_was(message):
    assert messages.decode_from_worker(messages.encode(message)) == message


@pytest.mark.parametrize("message", [Abort([("r", None), ("s", 1)]), Shutdown()])
def test_what_the_server_sends_comes_back_as_it_was(message):
    assert messages.decode_to_worker(messages.encode(message)) == message


def test_the_detokenizer_fields_stay_in_the_http_process():
    params = SamplingParams(n=2, temperature=0, max_tokens=7, stop=["\n\n"], include_stop_str_in_output=True,
                            skip_special_tokens=False, logit_bias={3: 1.5}, min_tokens=2)
    add = messages.decode_to_worker(messages.encode(messages.add_request("r", [1, 2], params)))
    sent = messages.engine_params(add)
    assert (sent.stop, sent.include_stop_str_in_output, sent.skip_special_tokens) == ([], False, True)
    assert (sent.n, sent.temperature, sent.max_tokens, sent.min_tokens, sent.logit_bias) == (2, 0, 7, 2, {3: 1.5})


def test_the_worker_checks_the_fields_shape_not_their_values_again(monkeypatch):
    """Validated once where they were made (the HTTP edge); the worker only checks count and types."""
    frame = messages.encode(messages.add_request("r", [1], SamplingParams(n=2, seed=7)))
    add = messages.decode_to_worker(frame)
    monkeypatch.setattr(SamplingParams, "validate", lambda self: pytest.fail("validated again in the worker"))
    sent = messages.engine_params(add)
    assert (sent.n, sent.seed, sent.temperature, sent.stop) == (2, 7, 1.0, [])
    kind, request_id, prompt, params = msgspec.msgpack.decode(frame)
    for bad in (["two"] + params[1:], params[:-1]):
        with pytest.raises(messages.MalformedAdd, match="malformed request fields") as refused:
            messages.decode_to_worker(msgspec.msgpack.encode([kind, request_id, prompt, bad]))
        assert refused.value.request_id == "r"  # the worker fails that request alone


def test_an_add_carries_every_engine_field_of_sampling_params_by_position():
    """``Add.params`` mirrors ``SamplingParams`` less the detokenizer's fields, in its order, without names."""
    engine_fields = [f.name for f in fields(SamplingParams) if f.name not in DETOKENIZER_FIELDS]
    assert list(messages.EngineSampling.__struct_fields__) == engine_fields
    params = SamplingParams(n=3, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, presence_penalty=0.2,
                            frequency_penalty=0.3, repetition_penalty=1.1, seed=4, max_tokens=9, min_tokens=1,
                            stop_token_ids=[7], ignore_eos=True, logprobs=2, json_schema={"type": "object"},
                            json_schema_after_token=8, logit_bias={3: -1.0}, prompt_logprobs=1)
    frame = messages.encode(messages.add_request("r", [1, 2], params))
    _, _, _, positional = msgspec.msgpack.decode(frame)
    assert positional == [getattr(params, name) for name in engine_fields]
    sent = messages.engine_params(messages.decode_to_worker(frame))
    assert all(getattr(sent, name) == getattr(params, name) for name in engine_fields)
    assert len(messages.encode(messages.add_request("r", [1, 2], SamplingParams()))) < 90  # the names: 250 more


def test_an_error_is_the_clients_or_ours():
    assert RequestError("bad schema", client_fault=True).status == 400
    assert RequestError("the engine failed").status == 500
    assert RequestError("worker died", unavailable=True, retryable=True).status == 503


def test_a_malformed_frame_is_refused_by_its_type():
    with pytest.raises(msgspec.ValidationError):
        messages.decode_to_worker(msgspec.msgpack.encode(["add", "r", "not token ids", []]))


def test_a_pooling_request_and_its_output_cross_as_they_were():
    params = PoolingParams("embed", dimensions=16, normalize=False)
    add = messages.add_request("r", [5, 6], params)
    decoded = messages.decode_to_worker(messages.encode(add))
    assert isinstance(decoded, messages.AddPooling) and messages.engine_params(decoded) == params
    out = Outputs([StepOutput("r", 0, [], True, "stop", pooled=[0.25, -1.5])])
    assert messages.decode_from_worker(messages.encode(out)) == out
    with pytest.raises(messages.MalformedAdd, match="malformed request fields"):
        messages.decode_to_worker(msgspec.msgpack.encode(["pool", "r", [5], ["embed", "sixteen", None, True]]))
