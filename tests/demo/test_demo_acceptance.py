"""The demo model through our own engine: readable stories, on topic, and transformers' ids.

The issue's acceptance: greedy "Once upon a time" is a grammatical story of the corpus's kind;
the chat request "Tell me a story about a fox" is a story about a fox; and the engine's greedy
token ids equal the ones transformers produced from the same weights when the model was made
(tests/demo/reference.json, written by tools/train_demo.py). No torch is needed here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from triollm.demo import default_model_dir
from triollm.demo import grammar as g
from triollm.model.loader import LoadedModel, load_model
from triollm.model.sampling import SamplingParams
from triollm.offline import Engine, engine_config
from triollm.spec import GenerationSpec

REFERENCE = json.loads((Path(__file__).parent / "reference.json").read_text())
PROMPTS = {p["name"]: p for p in REFERENCE["prompts"]}
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(default_model_dir())


@pytest.fixture(scope="module")
def engine(loaded: LoadedModel) -> Engine:
    return Engine(loaded, engine_config(loaded))


def greedy(
    engine: Engine, prompt_ids: Sequence[int], max_tokens: int, stop: frozenset[int]
) -> list[int]:
    with engine.generate(prompt_ids, GREEDY, max_tokens, stop) as generation:
        return [t.token_id for t in generation]


def story_until_eos(engine: Engine, loaded: LoadedModel, prompt_ids: list[int]) -> str:
    """The greedy answer's text; it must end on an EOS token within the reference's budget."""
    eos = loaded.tokenizer.eos_token_ids | loaded.config.eos_token_ids
    ids = greedy(engine, prompt_ids, REFERENCE["max_new_tokens"], eos)
    assert ids[-1] in eos, "the story did not end"
    text = loaded.tokenizer.decode(ids[:-1])
    assert "\ufffd" not in text  # no half-decoded bytes
    assert text.isascii() and text.isprintable(), repr(text)
    return text


def test_once_upon_a_time_continues_as_a_grammatical_story(
    engine: Engine, loaded: LoadedModel
) -> None:
    prompt = "Once upon a time"
    text = prompt + story_until_eos(engine, loaded, loaded.tokenizer.encode(prompt))
    assert not g.unknown_words(text)
    parsed = g.parse_story(text)  # every sentence is one of the grammar's templates
    assert parsed[0].template.stage == "opening"
    assert parsed[-1].template.stage == "the_end"
    assert len(parsed) >= 5


@pytest.mark.parametrize(
    ("request_text", "slot", "word"),
    [
        ("Tell me a story about a fox", "animal", "fox"),
        ("Can you tell me a story about the forest?", "place", "forest"),
        ("Write a story about a kite.", "thing", "kite"),
    ],
)
def test_a_chat_request_gets_a_story_about_exactly_that(
    engine: Engine, loaded: LoadedModel, request_text: str, slot: str, word: str
) -> None:
    prompt_ids = loaded.tokenizer.encode_chat([{"role": "user", "content": request_text}])
    text = story_until_eos(engine, loaded, prompt_ids)
    assert word in text.split(" ") or f"{word}." in text
    assert not g.unknown_words(text)
    parsed = g.parse_story(text)
    assert parsed[0].template.stage == "opening"
    # The topic fills its role: the fox is the hero, the forest is home, the kite is found.
    assert {p.values[slot] for p in parsed if slot in p.values} == {word}


def prompt_ids_of(loaded: LoadedModel, prompt: dict[str, Any]) -> list[int]:
    if "messages" in prompt:
        return loaded.tokenizer.encode_chat(prompt["messages"])
    return loaded.tokenizer.encode(prompt["text"])


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_our_tokenizer_encodes_the_prompts_as_transformers_did(
    loaded: LoadedModel, name: str
) -> None:
    assert prompt_ids_of(loaded, PROMPTS[name]) == PROMPTS[name]["prompt_ids"]


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_greedy_ids_equal_transformers_until_eos(
    engine: Engine, loaded: LoadedModel, name: str
) -> None:
    prompt = PROMPTS[name]
    eos = frozenset(REFERENCE["eos_token_ids"])
    ids = greedy(engine, prompt["prompt_ids"], REFERENCE["max_new_tokens"], eos)
    assert ids == prompt["greedy_ids"]


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_greedy_ids_equal_transformers_past_eos(engine: Engine, name: str) -> None:
    # With EOS ignored the model goes on into a new document, as it did in packed training.
    prompt = PROMPTS[name]
    expected = prompt["ignore_eos_ids"]
    assert greedy(engine, prompt["prompt_ids"], len(expected), frozenset()) == expected


def run_cli(*args: str) -> str:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    proc = subprocess.run(
        [sys.executable, "-m", "triollm.cli", "generate", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.slow
def test_triollm_generate_without_a_model_dir_tells_the_demo_story() -> None:
    once = PROMPTS["once_upon_a_time"]
    out = run_cli("--prompt", "Once upon a time", "--temperature", "0", "--max-tokens", "200")
    assert once["greedy_text"] in out
    fox = PROMPTS["chat_fox"]
    out = run_cli("--chat", "--prompt", "Tell me a story about a fox", "--temperature", "0")
    assert fox["greedy_text"][:60] in out


def test_greedy_chat_stories_follow_nearly_every_topic_of_the_grammar(loaded: LoadedModel) -> None:
    # All 64 topics in one batch of 8 slots: every answer parses, and at most 4 name another
    # topic (the shipped model misses 2: the lion and the puppy; docs/demo-model.md, Limits).
    topics = [("animal", w) for w in g.ANIMALS]
    topics += [("place", w) for w in g.PLACES] + [("thing", w) for w in g.THINGS]
    eos = loaded.tokenizer.eos_token_ids | loaded.config.eos_token_ids
    requests = []
    for kind, word in topics:
        phrase = f"the {word}" if kind == "place" else f"{g.article(word)} {word}"
        messages = [{"role": "user", "content": f"Tell me a story about {phrase}"}]
        ids = tuple(loaded.tokenizer.encode_chat(messages))
        requests.append(GenerationSpec(ids, GREEDY, REFERENCE["max_new_tokens"], frozenset(eos)))
    completions = Engine(loaded, engine_config(loaded, slots=8)).generate_many(requests)
    off_topic = []
    for (kind, word), completion in zip(topics, completions, strict=True):
        ids = completion.token_ids
        assert ids[-1] in eos
        parsed = g.parse_story(loaded.tokenizer.decode(ids[:-1]))
        if {p.values[kind] for p in parsed if kind in p.values} != {word}:
            off_topic.append(word)
    assert len(off_topic) <= 4, off_topic


def test_sampled_stories_mostly_stay_in_the_grammar(loaded: LoadedModel) -> None:
    # Temperature 1 can mix templates; the shipped model keeps 29 of these 32 seeded samples
    # grammatical. A model that only looked fluent under greedy decoding would fail this.
    eos = loaded.tokenizer.eos_token_ids | loaded.config.eos_token_ids
    prompt = tuple(loaded.tokenizer.encode("Once upon a time"))
    requests = [
        GenerationSpec(prompt, SamplingParams(temperature=1.0, seed=seed), 200, frozenset(eos))
        for seed in range(32)
    ]
    grammatical = 0
    for completion in Engine(loaded, engine_config(loaded, slots=8)).generate_many(requests):
        ids = completion.token_ids
        text = "Once upon a time" + loaded.tokenizer.decode(ids[:-1] if ids[-1] in eos else ids)
        try:
            g.parse_story(text)
            grammatical += 1
        except ValueError:
            pass
    assert grammatical >= 26
