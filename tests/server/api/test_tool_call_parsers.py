"""Each family's tool-call parser on recorded outputs (tests/fixtures/tool_calls), whole and streamed;
the forced ``required`` format read in pieces; which parser a chat template implies."""

import json
from pathlib import Path

import pytest

from xinserve.server.api.tool_calls import PARSERS, detect, parser_for
from xinserve.server.api.tool_calls.forced import NamedCall, RequiredCalls
from xinserve.server.api.tool_calls.stream import ParsedCalls

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "tool_calls"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_forecast", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "hourly": {"type": "boolean"}}}}},
]
# The assistant tool-call markup of GLM-4.5's and GLM-4.7's chat templates (zai-org/GLM-4.5 and
# zai-org/GLM-4.7, chat_template.jinja; GLM-5 writes GLM-4.7's), rendered as transformers does.
GLM45_CALLS = (
    "{% for tc in tool_calls %}\n{%- if tc.function %}\n    {%- set tc = tc.function %}\n{%- endif %}\n"
    "{{ '\\n<tool_call>' + tc.name }}\n{% set _args = tc.arguments %}\n{% for k, v in _args.items() %}\n"
    "<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>\n"
    "{% endfor %}\n</tool_call>{% endfor %}"
)
GLM47_CALLS = (
    "{% for tc in tool_calls %}\n{%- if tc.function %}\n    {%- set tc = tc.function %}\n{%- endif %}\n"
    "{{- '<tool_call>' + tc.name -}}\n{% set _args = tc.arguments %}{% for k, v in _args.items() %}<arg_key>{{ k }}"
    "</arg_key><arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>{% endfor %}"
    "</tool_call>{% endfor %}"
)
CASES = [(family, case) for family in PARSERS for case in json.loads((FIXTURES / f"{family}.json").read_text())]


def _calls_from_deltas(deltas: list[dict]) -> list[list[str]]:
    calls: dict[int, list[str]] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], ["", ""])
        call[0] += d.get("function", {}).get("name") or ""
        call[1] += d.get("function", {}).get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize(("family", "case"), CASES, ids=[f"{f}-{c['name']}" for f, c in CASES])
def test_parser_on_recorded_output(family, case):
    parsed = PARSERS[family](TOOLS).parse(case["text"])
    assert parsed.content == case["content"]
    assert [[c.name, c.arguments] for c in parsed.calls] == case["calls"]
    for call in parsed.calls:
        assert call.id.startswith("call_")
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize(("family", "case"), CASES, ids=[f"{f}-{c['name']}" for f, c in CASES])
def test_streamed_pieces_give_the_same_calls(family, case):
    reader = ParsedCalls(PARSERS[family](TOOLS))
    content, deltas = "", []
    text = case["text"]
    for i in range(0, len(text), 3):  # three characters at a time, splitting every marker somewhere
        piece, more = reader.feed(text[i : i + 3])
        content, deltas = content + piece, deltas + more
    piece, more = reader.finish()
    content, deltas = content + piece, deltas + more
    assert _calls_from_deltas(deltas) == case["calls"]
    assert reader.has_calls == bool(case["calls"])
    if case["calls"]:
        assert content.strip() == (case["content"] or "")
    else:
        assert content == text  # nothing is lost when the output is not a call


def test_required_calls_read_in_pieces_equal_the_whole():
    text = ('[{"name": "get_weather", "arguments": {"city": "P\\"a}]ris", "unit": "c"}}, '
            '{"name": "get_time", "arguments": {"zone": "utc", "nested": [{"a": 1}]}}]')
    reader, deltas = RequiredCalls(), []
    for char in text:
        deltas += reader.feed(char)[1]
    _, whole = RequiredCalls().message(text)
    assert [[c["function"]["name"], c["function"]["arguments"]] for c in whole] == [
        ["get_weather", '{"city": "P\\"a}]ris", "unit": "c"}'],
        ["get_time", '{"zone": "utc", "nested": [{"a": 1}]}'],
    ]
    assert _calls_from_deltas(deltas) == [[c["function"]["name"], c["function"]["arguments"]] for c in whole]
    assert sum(1 for d in deltas if d.get("function", {}).get("name")) == 2  # each name once


def test_named_call_streams_the_whole_output_as_arguments():
    reader = NamedCall("get_time")
    deltas = reader.feed('{"zone": ')[1] + reader.feed('"utc"}')[1] + reader.finish()[1]
    assert deltas[0]["id"].startswith("call_") and deltas[0]["function"]["name"] == "get_time"
    assert _calls_from_deltas(deltas) == [["get_time", '{"zone": "utc"}']]
    _, calls = reader.message('{"zone": "utc"}')
    assert calls[0]["id"] == deltas[0]["id"]


@pytest.mark.parametrize(("template", "expected"), [
    ("{% for m in messages %}<tool_call>\n{{ m }}</tool_call>{% endfor %}", "hermes"),
    ("<tool_call>{{ tc.name }}\n<arg_key>{{ k }}</arg_key>", "glm45"),
    ("{{- '<tool_call>' + tc.name -}}{% for k, v in _args.items() %}<arg_key>{{ k }}</arg_key><arg_value>", "glm47"),
    (GLM45_CALLS, "glm45"),
    (GLM47_CALLS, "glm47"),
    ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>", "deepseek_v3"),
    ("<|start_header_id|>ipython<|end_header_id|><|python_tag|>", "llama3_json"),
    ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}", None),
    (None, None),
])
def test_parser_detected_from_chat_template(template, expected):
    assert detect(template) == expected


@pytest.mark.parametrize(("family", "template"), [("glm45", GLM45_CALLS), ("glm47", GLM47_CALLS)])
def test_glm_calls_rendered_by_their_template_parse_back(family, template, tiny_tokenizer):
    tools = [*TOOLS, {"type": "function", "function": {"name": "configure", "parameters": {"type": "object", "properties": {
        "label": {"type": "string"}, "options": {"type": "object"}, "count": {"type": "integer"}}}}}]
    calls = [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}},
        {"type": "function", "function": {"name": "configure", "arguments": {
            "label": "a <b> & \"c\"\nd", "options": {"depth": [1, 2], "name": "é"}, "count": 7}}},
        {"type": "function", "function": {"name": "get_time", "arguments": {}}},
    ]
    # Rendered by transformers itself (its Jinja settings and its tojson filter).
    text = tiny_tokenizer.apply_chat_template(
        [{"role": "assistant", "content": "", "tool_calls": calls}], tokenize=False,
        chat_template="{% for m in messages %}{% set tool_calls = m.tool_calls %}" + template + "{% endfor %}")
    if family == "glm47":  # the compact layout: nothing between a call's tags
        assert text.startswith("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Zürich</arg_value>")
        assert "</tool_call><tool_call>get_time</tool_call>" in text
    parsed = PARSERS[family](tools).parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert detect(template) == family


def test_configured_parser_wins_over_the_template():
    assert isinstance(parser_for("llama3_json", "<tool_call>", TOOLS), PARSERS["llama3_json"])
    assert parser_for(None, "plain", TOOLS) is None


def test_the_model_setting_offers_every_parser():
    from typing import get_args

    from xinserve.server.config import ModelSettings

    (names, _) = get_args(ModelSettings.model_fields["tool_call_parser"].annotation)
    assert set(get_args(names)) == set(PARSERS)


def test_the_serve_flag_selects_the_parser_of_every_model(tmp_path):
    import argparse

    from xinserve.server.cli.main import _add_serve_args, build_config

    parser = argparse.ArgumentParser()
    _add_serve_args(parser)
    config = build_config(parser.parse_args(["--model", str(tmp_path), "--tool-call-parser", "glm47"]), env={})
    assert [m.tool_call_parser for m in config.models] == ["glm47"]
    with pytest.raises(SystemExit):  # argparse refuses a name no parser has
        parser.parse_args(["--tool-call-parser", "glm99"])
