"""The openai-agents SDK with its default model class (OpenAIResponsesModel, i.e. /v1/responses) against
a live server of the scripted thinking model: a text answer, and a function tool it calls."""

import asyncio

import pytest
from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
from agents.models.openai_responses import OpenAIResponsesModel
from openai import AsyncOpenAI

from tests.server.thinking_model import ANSWER, CALL, KEYS


@pytest.fixture
def model(thinking_server):
    """A model on a fresh client: an httpx client is bound to the event loop of its first request."""
    set_tracing_disabled(True)  # tracing would post to api.openai.com
    client = AsyncOpenAI(base_url=f"{thinking_server.url}/v1", api_key=KEYS[0], max_retries=0, timeout=120)
    return OpenAIResponsesModel(model="thinker", openai_client=client)


def test_agent_answers_with_text(model):
    agent = Agent(name="brief", instructions="Answer briefly.", model=model, model_settings=ModelSettings(temperature=0))
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?"))
    # Without tools the model's call syntax is plain text after its answer; the reasoning is an item.
    assert result.final_output == f"{ANSWER}<tool_call>{CALL}</tool_call>"
    assert [item.type for item in result.new_items] == ["reasoning_item", "message_output_item"]


def test_agent_calls_a_function_tool(model):
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        seen.append(city)
        return f"21 degrees in {city}"

    agent = Agent(name="weather", model=model, tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(temperature=0))
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?"))
    assert seen == ["Paris"] and result.final_output == "21 degrees in Paris"
