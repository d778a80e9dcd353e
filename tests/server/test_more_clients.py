"""Three more clients people point at a local server, each in its users' common flow.

- **litellm** (``openai/<model>`` with ``api_base``): a plain completion, and a tool
  round trip (a forced call, the tool's result sent back, the answer after it).
- **instructor** (``from_openai``, its default ``Mode.TOOLS``: a named tool choice): a
  structured extraction into a pydantic model.
- **the OpenAI Agents SDK** (``OpenAIChatCompletionsModel`` over ``AsyncOpenAI``): an
  agent with a function tool, ``tool_choice="required"``: the SDK calls the tool, sends
  its output back, and ends with the model's message.

The fixture model is random, so what is checked is the protocol, never the prose: a
forced call follows the tool's schema (the grammar holds it), each request of a flow is
answered, and the pieces each client builds from the answers are there. The fixture has
a Hermes template (``apikit.hermes_model``), so after the forced call the SDK's ``auto``
turn is parsed as the real Qwen's would be. docs/serving.md records the same flows on
the real Qwen2.5-Coder-0.5B. Each test skips, naming the package, when it is missing.
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Any

import pytest
import trio
from apikit import CHAT_TOOLS, WEATHER, hermes_model
from pydantic import BaseModel, ConfigDict, Field
from serverkit import MODEL_ID, live_server

WEATHER_SAYS = "Sunny, 22 C"


@pytest.fixture(scope="module")
def hermes_loaded(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return hermes_model(tmp_path_factory.mktemp("hermes-clients"))


def _import(name: str) -> Any:
    return pytest.importorskip(name, reason=f"{name} is not installed (the dev extra has it)")


async def test_litellm_completes_and_makes_a_tool_round_trip(hermes_loaded, monkeypatch):
    # Offline, litellm would try to fetch its model cost map on import (10 s of retries).
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = _import("litellm")
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    async with live_server(hermes_loaded, model_name=MODEL_ID, context_tokens=512) as live:
        common = {"model": f"openai/{MODEL_ID}", "api_base": live.url + "/v1", "api_key": "x"}

        def flow() -> tuple[Any, Any, Any]:
            plain = litellm.completion(messages=ask, max_tokens=4, **common)
            called = litellm.completion(
                messages=ask,
                tools=CHAT_TOOLS,
                tool_choice="required",
                parallel_tool_calls=False,
                max_tokens=200,
                **common,
            )
            call = called.choices[0].message.tool_calls[0]
            result = {"role": "tool", "tool_call_id": call.id, "content": WEATHER_SAYS}
            turn = called.choices[0].message.model_dump(exclude_none=True)
            after = litellm.completion(
                messages=[*ask, turn, result], tools=CHAT_TOOLS, max_tokens=4, **common
            )
            return plain, called, after

        plain, called, after = await trio.to_thread.run_sync(flow)
    assert plain.choices[0].finish_reason in ("stop", "length")
    assert plain.usage.completion_tokens >= 1
    call = called.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == set(WEATHER["required"])
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert after.usage.prompt_tokens > called.usage.prompt_tokens  # the result went in


class Person(BaseModel):
    # extra="forbid": the schema closes the object (additionalProperties false), else the
    # grammar lets the random model add keys until max_tokens, as any model could
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(max_length=12)]
    age: Annotated[int, Field(ge=0, le=150)]


async def test_instructor_extracts_a_validated_model(hermes_loaded):
    instructor = _import("instructor")
    import openai

    async with live_server(hermes_loaded, model_name=MODEL_ID, context_tokens=512) as live:
        client = instructor.from_openai(
            openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0),
            mode=instructor.Mode.TOOLS,
        )

        def extract() -> Person:
            return client.chat.completions.create(
                model=MODEL_ID,
                response_model=Person,
                messages=[{"role": "user", "content": "Extract: John is 30 years old."}],
                max_tokens=200,
                max_retries=1,
            )

        person = await trio.to_thread.run_sync(extract)
    # The grammar held the call to Person's schema, and pydantic validated it.
    assert isinstance(person, Person)
    assert len(person.name) <= 12 and 0 <= person.age <= 150


async def test_the_agents_sdk_calls_a_tool_and_ends_with_a_message(hermes_loaded, monkeypatch):
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")  # no export to OpenAI
    agents = _import("agents")
    import openai

    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=10)]) -> str:
        """The weather in a city now."""
        calls.append(city)
        return f"{WEATHER_SAYS} in {city}"

    async with live_server(hermes_loaded, model_name=MODEL_ID, context_tokens=512) as live:
        model = agents.OpenAIChatCompletionsModel(
            model=MODEL_ID,
            openai_client=openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0),
        )
        agent = agents.Agent(
            name="weather",
            instructions="Answer with the tool.",
            tools=[get_weather],
            model=model,
            model_settings=agents.ModelSettings(
                tool_choice="required", parallel_tool_calls=False, max_tokens=100
            ),
        )

        def run() -> Any:
            agents.set_tracing_disabled(True)
            return agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)

        result = await trio.to_thread.run_sync(run)
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"], kinds
    assert len(calls) == 1  # the SDK ran our function with the model's arguments
    assert kinds[-1] == "MessageOutputItem" and isinstance(result.final_output, str)
    assert os.environ["OPENAI_AGENTS_DISABLE_TRACING"] == "1"
