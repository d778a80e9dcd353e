"""The story grammar: what it accepts, what it rejects, and that the corpus stays inside it."""

from __future__ import annotations

import itertools
import random
import re

import jinja2.sandbox
import pytest

from triollm.demo import corpus
from triollm.demo import grammar as g


def assistant_text(document: str) -> str:
    """The story part of a training document: the assistant's turn, or the plain story."""
    text = document.removesuffix(corpus.END_OF_TEXT)
    if corpus.IM_START in text:
        return text.split(f"{corpus.IM_START}assistant\n")[1].split(corpus.IM_END)[0]
    return text


def test_the_same_seed_gives_the_same_documents() -> None:
    first = list(itertools.islice(corpus.documents(7), 50))
    again = list(itertools.islice(corpus.documents(7), 50))
    other = list(itertools.islice(corpus.documents(8), 50))
    assert first == again
    assert first != other


def test_every_generated_document_parses_under_the_grammar() -> None:
    for document in itertools.islice(corpus.documents(3), 1500):
        text = assistant_text(document)
        parsed = g.parse_story(text)  # raises ValueError naming the sentence
        assert parsed, document
        assert not g.unknown_words(text), document


def test_a_story_has_the_fixed_plot_order() -> None:
    rng = random.Random(5)
    for _ in range(200):
        stages = [p.template.stage for p in g.parse_story(corpus.story(rng))]
        assert stages[0] == "opening"
        assert stages[-2:] == ["ending", "the_end"]
        assert stages.index("find") < stages.index("feel")


@pytest.mark.parametrize(
    ("kind", "word", "slot"),
    [("animal", "fox", "animal"), ("place", "forest", "place"), ("thing", "kite", "thing")],
)
def test_a_story_about_a_topic_uses_it_in_its_role(kind: str, word: str, slot: str) -> None:
    rng = random.Random(11)
    for _ in range(100):
        text = corpus.story_about(rng, corpus.Topic(kind, word))  # type: ignore[arg-type]
        held = {p.values[slot] for p in g.parse_story(text) if slot in p.values}
        assert held == {word}, text


def test_chat_requests_name_the_topic_the_answer_is_about() -> None:
    rng = random.Random(2)
    checked = 0
    for _ in range(300):
        messages = corpus.chat(rng)
        request, answer = messages[-2]["content"], messages[-1]["content"]
        if "about" not in request:
            continue
        topic = request.split("about ")[1].split()[1].strip(".,?")
        assert topic in g.ANIMALS + g.PLACES + g.THINGS
        assert topic in re.findall(r"[a-z]+", answer), (request, answer)
        checked += 1
    assert checked > 200


def test_the_parser_rejects_sentences_the_grammar_cannot_make() -> None:
    good = "Once upon a time, there was a little fox named Tom."
    assert g.parse_sentence(good) is not None
    assert g.parse_sentence(good.replace("little fox", "fox little")) is None  # word order
    assert g.parse_sentence(good.replace("fox", "dragon")) is None  # not in the vocabulary
    assert g.parse_sentence(good.removesuffix(".")) is None  # unfinished
    # The same slot twice in one template must hold the same word.
    both = "One day, while he was playing near the lake, he found a red ball under a tree."
    assert g.parse_sentence(both) is not None
    assert g.parse_sentence(both.replace(", he found", ", she found")) is None


def test_parse_story_names_the_bad_sentence_and_an_unfinished_tail() -> None:
    with pytest.raises(ValueError, match="not in the grammar"):
        g.parse_story("Once upon a time, there was a little fox named Tom. Tom ate the moon.")
    with pytest.raises(ValueError, match="unfinished"):
        g.parse_story("Once upon a time, there was a little fox named Tom. Tom lived")


def test_unknown_words_finds_words_outside_the_grammar() -> None:
    assert g.unknown_words("The fox found a shiny key.") == set()
    assert g.unknown_words("The fox found a quantum key.") == {"quantum"}


def test_the_grammar_makes_hundreds_of_thousands_of_distinct_sentences() -> None:
    assert g.distinct_sentences() > 300_000
    # Measured, not only counted: a modest sample already repeats few sentences.
    sentences: set[str] = set()
    for document in itertools.islice(corpus.documents(4), 3000):
        sentences.update(g.split_sentences(assistant_text(document))[0])
    assert len(sentences) > 10_000


def test_render_chat_matches_the_jinja_template_shipped_to_the_tokenizer() -> None:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment()
    template = env.from_string(corpus.CHAT_TEMPLATE)
    rng = random.Random(9)
    for _ in range(50):
        messages = corpus.chat(rng)
        for prompt in (False, True):
            expected = template.render(messages=messages, add_generation_prompt=prompt)
            assert corpus.render_chat(messages, add_generation_prompt=prompt) == expected
