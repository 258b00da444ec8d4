"""Chat messages through the model's template: roles, content parts, tools, and template errors."""

import json

import pytest

from xinserve.server.api.chat_template import chat_prompt_ids, template_message
from xinserve.server.api.openai.protocol import ChatCompletionRequest, ChatMessage
from xinserve.server.config import LimitsSettings
from xinserve.server.errors import APIError

MAX_CHARS = LimitsSettings().max_prompt_chars


def request(messages, **kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **kw})


def prompt_ids(tokenizer, request: ChatCompletionRequest, **kw) -> list[int]:
    return chat_prompt_ids(tokenizer, request, max_chars=kw.pop("max_chars", MAX_CHARS), **kw)


def test_template_message_fields():
    msg = ChatMessage.model_validate({"role": "developer", "content": [{"type": "text", "text": "a"}], "name": "x"})
    assert template_message(msg) == {"role": "system", "content": "a", "name": "x"}
    tool = ChatMessage.model_validate({"role": "tool", "content": "42", "tool_call_id": "call_1"})
    assert template_message(tool) == {"role": "tool", "content": "42", "tool_call_id": "call_1"}


def test_prompt_ids_follow_the_template(tiny_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    ids = prompt_ids(tiny_tokenizer, request(messages))
    expected = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tiny_tokenizer.decode(ids) == expected
    assert ids.count(tiny_tokenizer.bos_token_id) == 1  # no second BOS from add_special_tokens
    assert tiny_tokenizer.decode(ids).endswith("<|assistant|>\n")
    no_prompt = prompt_ids(tiny_tokenizer, request(messages, add_generation_prompt=False))
    assert ids[: len(no_prompt)] == no_prompt and len(no_prompt) < len(ids)


def test_template_errors_are_400(tiny_tokenizer):
    # The tiny template raises on roles it does not know; "developer" is mapped to "system" first.
    assert prompt_ids(tiny_tokenizer, request([{"role": "developer", "content": "x"}]))

    class NoTemplate:
        chat_template = None

    with pytest.raises(APIError) as info:
        prompt_ids(NoTemplate(), request([{"role": "user", "content": "x"}]))
    assert info.value.status == 400 and "completions" in info.value.message

    class Strict:
        chat_template = "x"

        def apply_chat_template(self, *a, **kw):
            from jinja2 import TemplateError

            raise TemplateError("roles must alternate")

    with pytest.raises(APIError) as info:
        prompt_ids(Strict(), request([{"role": "user", "content": "x"}]))
    assert info.value.param == "messages" and "alternate" in info.value.message


def test_assistant_tool_calls_reach_the_template_with_parsed_arguments(tiny_tokenizer):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}
    bad = {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
    msg = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [call, bad]})
    calls = template_message(msg)["tool_calls"]
    assert calls[0]["function"]["arguments"] == {"zone": "utc"}  # templates iterate or re-serialise them
    assert calls[1] == bad  # left as sent when it is not JSON
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    seen = {}

    class Recording:
        chat_template = "x"

        def apply_chat_template(self, messages, tools=None, **kw):
            seen.update(messages=messages, tools=tools)
            return "text"

        def encode(self, text, add_special_tokens):
            return [1]

    messages = [{"role": "user", "content": "time?"}, msg.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    prompt_ids(Recording(), request(messages, tools=tools))
    assert seen["tools"] == tools and seen["messages"][2] == {"role": "tool", "content": "12:00",
                                                              "tool_call_id": "call_1"}


@pytest.mark.parametrize("key", ["chat_template", "tokenize", "return_dict", "tools", "add_generation_prompt",
                                 "tokenizer_kwargs", "messages"])
def test_template_kwargs_that_are_not_template_variables_are_refused(tiny_tokenizer, key):
    # The body: 145 bytes that rendered a 4,000,001-token prompt through its own template.
    body = request([{"role": "user", "content": "x"}], chat_template_kwargs={key: "{{ 'ab ' * 2000000 }}"})
    with pytest.raises(APIError) as info:
        prompt_ids(tiny_tokenizer, body)
    assert info.value.status == 400 and info.value.param == f"chat_template_kwargs.{key}"
    # Template variables pass, to the template.
    assert prompt_ids(tiny_tokenizer, request([{"role": "user", "content": "x"}],
                                              chat_template_kwargs={"enable_thinking": False}))


def test_a_trusted_request_template_renders_within_the_character_bound(tiny_tokenizer):
    template = {"chat_template": "{{ 'ab ' * 2000000 }}"}
    body = request([{"role": "user", "content": "x"}], chat_template_kwargs=template)
    with pytest.raises(APIError) as info:  # refused before the 6,000,000 characters are tokenised
        prompt_ids(tiny_tokenizer, body, trust_template=True)
    assert info.value.status == 400 and info.value.code == "string_above_max_length"
    assert "6000000" in info.value.message
    small = request([{"role": "user", "content": "x"}], chat_template_kwargs={"chat_template": "{{ 'ab ' * 3 }}"})
    assert tiny_tokenizer.decode(prompt_ids(tiny_tokenizer, small, trust_template=True)) == "ab ab ab "
    # The bound holds for the model's own template too (tools render outside the messages' characters).
    plain = request([{"role": "user", "content": "Hello there"}])
    rendered = len(tiny_tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}],
                                                      add_generation_prompt=True, tokenize=False))
    assert prompt_ids(tiny_tokenizer, plain, max_chars=rendered)
    with pytest.raises(APIError):
        prompt_ids(tiny_tokenizer, plain, max_chars=rendered - 1)


@pytest.mark.parametrize("depth", [65, 500, 100_000])  # 100,000: past the JSON parser's own limit
def test_tool_call_arguments_nested_too_deeply_are_a_400_naming_them(tiny_tokenizer, depth):
    deep = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * depth + "]" * depth}}
    req = request([{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [deep]}])
    with pytest.raises(APIError) as info:  # once a RecursionError: a 500 with 3,000 lines of traceback
        prompt_ids(tiny_tokenizer, req)
    assert (info.value.status, info.value.param) == (400, "messages.1.tool_calls.0.function.arguments")


def test_tool_call_arguments_as_deep_as_the_body_may_be_are_templated(tiny_tokenizer):
    arguments = '{"a":' * 32 + "[" * 32 + "1" + "]" * 32 + "}" * 32
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    req = request([{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]}],
                  chat_template_kwargs={"deep": json.loads(arguments)})
    assert prompt_ids(tiny_tokenizer, req)
