"""The client libraries' own flows against a ``homepd serve`` base URL, shared by the fake-backend and the
real-model tests (this module holds no test): each runs the library unmodified, as its docs show it.
``max_tokens``: the fake backend writes a byte a token, so its answers need more tokens than SmolLM2's.  The
structured flows run greedy or seeded where the library lets a test say so, and ``Person`` bounds its strings
(``maxLength``, which the grammar enforces): a grammar keeps a free string well-formed, not short, and SmolLM2
greedy writes this name as "1000…" for as long as it may (one CI run ended at max_tokens that way)."""
from __future__ import annotations

import asyncio
import json

from pydantic import BaseModel, Field

MODEL = "smollm2-135m-instruct-q4_1"
SEED = 2  # the structured flows' seed: at the server's default temperature it closes the object early


class Address(BaseModel):
    street: str = Field(max_length=32)
    city: str = Field(max_length=32)


class Person(BaseModel):
    name: str = Field(max_length=32)
    age: int
    address: Address


def openai_agents_tool_run(base_url: str, api_key: str, max_tokens: int = 64) -> tuple[list[str], object]:
    """openai-agents: an agent with one function tool, forced to call it, whose output is the final answer."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"sunny in {city}"

    # why its own loop, the client closed in it: an AsyncOpenAI left open was collected during a later test's
    # event loop on the same xdist worker and failed it ("Event loop is closed" from its transport's aclose)
    async def run():
        async with AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
            agent = Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather],
                          model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
                          model_settings=ModelSettings(tool_choice="required", max_tokens=max_tokens),
                          tool_use_behavior="stop_on_first_tool")
            return await Runner.run(agent, "What is the weather in Paris?")

    result = asyncio.run(run())
    return cities, result.final_output


def pydantic_ai_structured(base_url: str, api_key: str, max_tokens: int = 256) -> Person:
    """pydantic-ai: a structured result, which pydantic-ai asks for as a call of its output tool."""
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    from openai import AsyncOpenAI

    async def run():  # (its own loop, its client closed in it: openai_agents_tool_run says why)
        async with AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
            agent = Agent(OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=client)), output_type=Person,
                          retries=2)
            return (await agent.run("Alice is 30 and lives at 1 Main St, Springfield.",
                                    model_settings={"max_tokens": max_tokens, "seed": SEED})).output

    return asyncio.run(run())


def instructor_nested(base_url: str, api_key: str, max_tokens: int = 256) -> Person:
    """instructor: a nested response_model (its default tools mode: a named function)."""
    import instructor
    from openai import OpenAI

    client = instructor.from_openai(OpenAI(base_url=base_url, api_key=api_key), mode=instructor.Mode.TOOLS)
    return client.chat.completions.create(model=MODEL, response_model=Person, max_tokens=max_tokens, max_retries=1,
                                          seed=SEED, messages=[{"role": "user",
                                                     "content": "Alice, 30, lives at 1 Main St, Springfield."}])


def langchain_flows(base_url: str, api_key: str, max_tokens: int = 160) -> tuple[list[dict], Person]:
    """langchain-openai: ``bind_tools`` (the call it gets back) and ``with_structured_output``."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_time(timezone: str) -> str:
        """The current time in a timezone."""
        return "12:00"

    llm = ChatOpenAI(base_url=base_url, api_key=api_key, model=MODEL, max_tokens=max_tokens, temperature=0)
    calls = llm.bind_tools([get_time], tool_choice="required").invoke("What time is it in UTC?").tool_calls
    person = llm.with_structured_output(Person).invoke("Alice, 30, lives at 1 Main St, Springfield.")
    return calls, person


def args_of(call) -> dict:
    return json.loads(call.function.arguments)
