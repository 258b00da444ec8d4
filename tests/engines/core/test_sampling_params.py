"""SamplingParams' ranges: each a finite interval, checked once where the params are made."""

import math

import pytest

from xinserve.engines.core.sampling_params import InvalidSamplingParam, SamplingParams

FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_non_finite_values_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidSamplingParam, match=field) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_logit_bias_values_are_refused(value):
    with pytest.raises(InvalidSamplingParam, match="logit_bias") as info:
        SamplingParams(logit_bias={3: value})
    assert info.value.field == "logit_bias"


@pytest.mark.parametrize("value", [1e-300, 0.0099, 0, -1, 100.5, 1e300])
def test_repetition_penalty_outside_its_range_is_refused(value):
    with pytest.raises(InvalidSamplingParam, match=r"repetition_penalty must be in \[0.01, 100\]"):
        SamplingParams(repetition_penalty=value)


@pytest.mark.parametrize("value", [0.01, 0.5, 1.0, 1.3, 100])
def test_repetition_penalty_within_its_range_is_accepted(value):
    assert SamplingParams(repetition_penalty=value).repetition_penalty == value


def test_temperature_has_an_upper_bound():
    assert SamplingParams(temperature=100).temperature == 100
    with pytest.raises(InvalidSamplingParam, match=r"temperature must be in \[0, 100\]"):
        SamplingParams(temperature=100.5)


def test_every_refusal_names_its_field():
    cases = {"n": {"n": 0}, "top_k": {"top_k": -1}, "max_tokens": {"max_tokens": 0},
             "min_tokens": {"min_tokens": -1}, "logprobs": {"logprobs": 21}, "seed": {"seed": 2**64},
             "stop": {"stop": [""]}, "prompt_logprobs": {"prompt_logprobs": -1},
             "logit_bias": {"logit_bias": {"x": 1}}}
    for field, values in cases.items():
        with pytest.raises(InvalidSamplingParam) as info:
            SamplingParams(**values)
        assert info.value.field == field, values
