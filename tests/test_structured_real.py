"""``test_structured_api``'s structured-output and tool tests on the real SmolLM2-135M-Instruct.

A trained model writes what it has learned where the grammar leaves it a choice (strings,
numbers, which enum value), unlike the random-weight model of ``test_structured_api``, so this
checks the grammar against real token preferences on a 49,152-token vocabulary: every answer
still validates, colocated and 1P+1D, greedy and sampled, streamed and not, and greedy output
is the same colocated, disaggregated (with a prefix-cache hit) and offline.
"""

from __future__ import annotations

import jsonschema
import pytest

from tests.test_structured_api import (  # noqa: F401  (fixtures, re-used with this model_dir)
    MAX_TOKENS,
    WEATHER,
    Pet,
    check_tool_call_stream,
    check_tool_choice,
    cluster,
    colocated,
    disagg,
    test_every_choice_validates_stream_and_not,
    test_greedy_is_the_same_colocated_disaggregated_and_offline,
    test_openai_parse_returns_a_parsed_object,
)

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def model_dir(real_model_dir):
    return real_model_dir


def test_langchain_bind_tools_and_with_structured_output(colocated):  # noqa: F811
    """As on the random model, with ``parallel_tool_calls=False``: asked for its tools with
    parallel calls allowed, this small model repeats the same call until ``max_tokens`` (the
    complete ones come back: ``test_tool_streaming``), which is its choice, not the grammar's."""
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(
        base_url=colocated.url + "/v1",
        api_key="unused",
        model="tiny",
        max_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=0,
    )
    tools = model.bind_tools([WEATHER], tool_choice="any", parallel_tool_calls=False)
    (call,) = tools.invoke("What is the weather in Lima for the next 3 days?").tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER["function"]["parameters"])
    pet = model.with_structured_output(Pet, method="json_schema").invoke("Describe a pet.")
    assert isinstance(pet, Pet)


def test_tool_choice_required_and_named(cluster):  # noqa: F811
    """As on the random model, but with parallel calls allowed this small model may repeat its
    call until ``max_tokens``: then the complete calls come back with ``finish_reason``
    "length", each one valid; with one call allowed the grammar ends the array after it."""
    check_tool_choice(cluster, [WEATHER], "get_weather", ("tool_calls", "length"))


def test_tool_calls_stream_openai_shaped_deltas(cluster):  # noqa: F811
    """As on the random model, with one call allowed: with parallel calls this small model may
    repeat its call (sampled) until ``max_tokens`` and cut the last one off."""
    check_tool_call_stream(cluster, parallel_tool_calls=False)


def test_openai_agents_sdk_over_the_responses_api(disagg):  # noqa: F811
    """The OpenAI Agents SDK's default model (``OpenAIResponsesModel``: /v1/responses) through
    1P+1D: an agent that must call its function tool, whose result the SDK runs and returns,
    and a plain agent, run and streamed, whose answers are the same text."""
    import asyncio

    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        calls.append(city)
        return f"sunny in {city}"

    async def run() -> tuple[str, str, str]:
        client = AsyncOpenAI(base_url=disagg.url + "/v1", api_key="unused", max_retries=0)
        model = OpenAIResponsesModel(model="tiny", openai_client=client)
        tool_agent = Agent(
            name="weather",
            instructions="Use your tools.",
            model=model,
            tools=[get_weather],
            model_settings=ModelSettings(tool_choice="required", max_tokens=60, temperature=0),
            tool_use_behavior="stop_on_first_tool",
        )
        plain = Agent(
            name="plain",
            instructions="Be brief.",
            model=model,
            model_settings=ModelSettings(max_tokens=120, temperature=0),
        )
        try:
            called = (await Runner.run(tool_agent, "What is the weather in Paris?")).final_output
            answer = (await Runner.run(plain, "Say hi")).final_output
            streamed = Runner.run_streamed(plain, "Say hi")
            async for _ in streamed.stream_events():
                pass
            return called, answer, streamed.final_output
        finally:
            await client.close()

    called, answer, streamed = asyncio.run(run())
    assert len(calls) == 1 and called == f"sunny in {calls[0]}"
    assert isinstance(answer, str) and answer and streamed == answer
