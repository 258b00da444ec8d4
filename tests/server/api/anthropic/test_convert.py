"""A Messages API request becomes the chat completions request it means (the one request path)."""

import pytest

from xinserve.server.api.anthropic.convert import chat_request
from xinserve.server.api.anthropic.protocol import CountTokensRequest, MessagesRequest
from xinserve.server.errors import APIError

WEATHER = {"name": "get_weather", "description": "Weather.", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}}}


def _messages(**kw) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 7, **kw})


def test_system_blocks_turns_and_sampling_fields():
    chat = chat_request(_messages(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        temperature=0.5, top_p=0.9, top_k=5, stop_sequences=["END"], metadata={"user_id": "u1"}, stream=True,
    ))
    assert [(m.role, m.text()) for m in chat.messages] == [("system", "Be brief.\nBe kind."), ("user", "a\nb")]
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.top_k, chat.stop, chat.user, chat.stream) == (
        7, 0.5, 0.9, 5, ["END"], "u1", True)
    assert chat.add_generation_prompt and chat.chat_template_kwargs is None


def test_tool_use_and_tool_result_become_tool_calls_and_tool_messages():
    chat = chat_request(_messages(tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Bergen"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "4C"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "down"}],
             "is_error": True},
            {"type": "text", "text": "Thanks."}]},
    ]))
    roles = [m.role for m in chat.messages]
    assert roles == ["user", "assistant", "tool", "tool", "user"]
    assistant = chat.messages[1]
    assert assistant.text() == "Checking."
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in assistant.tool_calls] == [
        ("toolu_1", "get_weather", '{"city": "Oslo"}'), ("toolu_2", "get_weather", '{"city": "Bergen"}')]
    assert [(m.tool_call_id, m.text()) for m in chat.messages[2:4]] == [("toolu_1", "4C"), ("toolu_2", "Error: down")]
    assert chat.tool_dicts() == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather.", "parameters": WEATHER["input_schema"]}}]


def test_an_assistant_turn_of_tool_use_only_has_no_content():
    chat = chat_request(_messages(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t"}]}]))
    assert chat.messages[1].content is None and chat.messages[2].text() == ""


@pytest.mark.parametrize(("choice", "expected", "parallel"), [
    ({"type": "auto"}, "auto", True),
    ({"type": "any"}, "required", True),
    ({"type": "none"}, "none", True),
    ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}, True),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
])
def test_tool_choice_maps_to_the_chat_one(choice, expected, parallel):
    chat = chat_request(_messages(tools=[WEATHER], tool_choice=choice, messages=[{"role": "user", "content": "x"}]))
    assert chat.tool_choice == expected and chat.parallel_tool_calls is parallel


def test_a_final_assistant_turn_is_continued():
    chat = chat_request(CountTokensRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": "The answer is"}]}))
    assert not chat.add_generation_prompt
    assert chat.chat_template_kwargs == {"continue_final_message": True}


def test_an_invalid_chat_request_is_a_400_naming_the_messages_field():
    with pytest.raises(APIError) as exc:
        chat_request(_messages(messages=[{"role": "user", "content": "x"}], stop_sequences=list("abcdef")))
    assert exc.value.status == 400 and exc.value.param == "stop_sequences"


def test_output_config_format_is_the_json_schema_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    chat = chat_request(_messages(messages=[{"role": "user", "content": "x"}],
                                  output_config={"format": {"type": "json_schema", "schema": schema}}))
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == schema


def test_output_config_format_and_forced_tool_use_do_not_mix():
    with pytest.raises(ValueError, match="output_config.format"):
        _messages(messages=[{"role": "user", "content": "x"}], tools=[WEATHER], tool_choice={"type": "any"},
                  output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}})
