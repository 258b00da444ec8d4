"""Each value range is checked in one place: a request model holds only the ranges its API
documents (OpenAI's, read from its own schema in tests/fixtures/openai-schemas/; Anthropic's, listed
below); every other range is the engine's, in ``SamplingParams.validate`` alone. A range added to a
request model that its API does not document (a copy of an engine range) fails here."""

import json
from pathlib import Path
from typing import Any

import annotated_types
import pytest
from pydantic import BaseModel

from xinserve.server.api.anthropic.protocol import MessagesRequest
from xinserve.server.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from xinserve.server.api.responses.protocol import ResponsesRequest

SCHEMAS = Path(__file__).resolve().parents[2] / "fixtures" / "openai-schemas"
# Anthropic's documented ranges for /v1/messages (it publishes no schema file we keep).
ANTHROPIC = {"max_tokens": {"ge": 1}, "temperature": {"ge": 0, "le": 1}, "top_p": {"ge": 0, "le": 1},
             "top_k": {"ge": 0}}
# vLLM's extras and the engine's own bounds: their ranges live in SamplingParams.validate alone.
ENGINE_ONLY = ("top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "seed")
_BOUNDS = {"minimum": "ge", "maximum": "le", "exclusiveMinimum": "gt", "exclusiveMaximum": "lt"}


def _properties(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """An object schema's properties, through ``$ref`` and ``allOf``."""
    if "$ref" in schema:
        return _properties(defs[schema["$ref"].rsplit("/", 1)[1]], defs)
    out: dict[str, Any] = {}
    for part in schema.get("allOf", []):
        out.update(_properties(part, defs))
    out.update(schema.get("properties", {}))
    return out


def documented(schema_file: str) -> dict[str, dict[str, float]]:
    """Field -> the bounds OpenAI's schema gives it (``{"ge": 0, "le": 2}``), for bounded fields."""
    schema = json.loads((SCHEMAS / schema_file).read_text())
    out = {}
    for name, prop in _properties(schema, schema.get("$defs", {})).items():
        for candidate in (prop, *prop.get("anyOf", [])):  # ``anyOf: [{number, bounds}, {null}]``
            bounds = {_BOUNDS[k]: v for k, v in candidate.items() if k in _BOUNDS}
            if bounds:
                out[name] = bounds
    return out


def model_ranges(model: type[BaseModel]) -> dict[str, dict[str, float]]:
    """Field -> the numeric bounds its pydantic field checks."""
    out = {}
    for name, info in model.model_fields.items():
        bounds = {}
        for meta in info.metadata:
            for kind in ("ge", "gt", "le", "lt"):
                if isinstance(meta, getattr(annotated_types, kind.capitalize())):
                    bounds[kind] = getattr(meta, kind)
        if bounds:
            out[name] = bounds
    return out


@pytest.mark.parametrize(("model", "ranges"), [
    (ChatCompletionRequest, lambda: documented("CreateChatCompletionRequest.json")),
    (CompletionRequest, lambda: documented("CreateCompletionRequest.json")),
    (ResponsesRequest, lambda: documented("Response.json")),  # the create body's sampling fields echoed
    (MessagesRequest, lambda: ANTHROPIC),
], ids=["chat", "completions", "responses", "anthropic"])
def test_a_request_model_checks_only_the_ranges_its_api_documents(model, ranges):
    checked, allowed = model_ranges(model), ranges()
    undocumented = {name: bounds for name, bounds in checked.items() if allowed.get(name) != bounds}
    assert not undocumented, f"ranges no API documents (the engine's: SamplingParams.validate): {undocumented}"


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest, ResponsesRequest])
def test_the_engines_ranges_are_not_repeated_in_an_openai_request_model(model):
    assert not set(model_ranges(model)) & set(ENGINE_ONLY)
    assert {"temperature", "top_p"} <= set(model_ranges(model))  # the introspection sees the ranges there are


def test_openais_schema_documents_the_ranges_the_models_keep():
    chat = documented("CreateChatCompletionRequest.json")
    assert (chat["temperature"], chat["top_p"], chat["n"]) == ({"ge": 0, "le": 2}, {"ge": 0, "le": 1},
                                                               {"ge": 1, "le": 128})
    assert chat["presence_penalty"] == chat["frequency_penalty"] == {"ge": -2, "le": 2}
    assert documented("CreateCompletionRequest.json")["logprobs"] == {"ge": 0, "le": 5}
