"""The demo model's training text: stories and ChatML chats drawn from the grammar by a seed.

`documents(seed)` is the whole corpus: an endless, reproducible stream of training documents,
each one either a plain story ending in `<|endoftext|>` or a ChatML exchange in which the user
asks for a story about an animal, a place or a thing and the assistant tells one about exactly
that. The same seed always gives the same stream, so retraining reads the same text.

Why generated text: no machine here can download a dataset, and a grammar we wrote ourselves
is the only text we know is ours to ship. Its combinations (see `grammar.distinct_sentences`)
are far more than a two-million-parameter model can memorise in the tokens it sees, so the
model has to learn the structure: opening, hero, place, find, a small adventure, ending.

Caller's trap: the chat rendering here and the Jinja `CHAT_TEMPLATE` written into
tokenizer_config.json must produce the same characters, or the model is trained on one prompt
format and served another;
tests/demo/test_grammar.py::test_render_chat_matches_the_jinja_template_shipped_to_the_tokenizer
renders both and compares them.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from triollm.demo import grammar as g

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)

# ChatML, the format Qwen and SmolLM2 use; `add_generation_prompt` opens the assistant's turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TopicKind = Literal["animal", "place", "thing"]


@dataclass(frozen=True)
class Topic:
    """What the user asked a story about: one word from `ANIMALS`, `PLACES` or `THINGS`."""

    kind: TopicKind
    word: str

    def phrase(self, rng: random.Random) -> str:
        """How the user names it: "a fox", "an owl", "the forest" or "a forest"."""
        if self.kind == "place" and rng.random() < 0.7:
            return f"the {self.word}"
        return f"{g.article(self.word)} {self.word}"


# How a user asks. "{x}" is the topic phrase; lower-case and unpunctuated variants are there
# because people type them, and the acceptance prompt "Tell me a story about a fox" has no
# full stop.
STORY_REQUESTS = (
    "Tell me a story about {x}.",
    "Tell me a story about {x}",
    "tell me a story about {x}",
    "Can you tell me a story about {x}?",
    "Please tell me a story about {x}.",
    "I want a story about {x}.",
    "Write a story about {x}.",
    "Tell me a story about {x}, please.",
    "Could you tell a story about {x}?",
    "A story about {x}, please.",
    "Tell a short story about {x}.",
)
ANY_STORY_REQUESTS = (
    "Tell me a story.",
    "Tell me a story",
    "Can you tell me a story?",
    "I want to hear a story.",
    "Tell me a bedtime story.",
)
GREETINGS = ("Hello", "Hello!", "Hi", "Hi there!", "Who are you?", "What can you do?")
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a storyteller.",
    "You tell short stories for children.",
)


def story(
    rng: random.Random,
    *,
    animal: str | None = None,
    place: str | None = None,
    thing: str | None = None,
) -> str:
    """One story from the grammar; a given animal, place or thing is used for that role.

    The hero is the animal, the hero lives near the place, and the thing is what the hero
    finds, so each of them appears in the text whichever templates are drawn.
    """
    name = rng.choice(g.NAMES)
    hero = animal or rng.choice(g.ANIMALS)
    hobby, hobby_past = rng.choice(g.HOBBIES)
    spot = rng.choice(g.SPOTS)
    values = {
        "name": name,
        **g.pronouns_for(name),
        "animal": hero,
        "cadj": rng.choice(g.CHARACTER_ADJECTIVES),
        "place": place or rng.choice(g.PLACES),
        "home": rng.choice(g.HOMES),
        "hadj": rng.choice(g.HOME_ADJECTIVES),
        "hobby": hobby,
        "hobby_past": hobby_past,
        "thing": thing or rng.choice(g.THINGS),
        "tadj": rng.choice(g.THING_ADJECTIVES),
        "spot": spot,
        "spot2": rng.choice([s for s in g.SPOTS if s != spot]),
        "feel_find": rng.choice(g.FIND_FEELINGS),
        "feel_good": rng.choice(g.GOOD_FEELINGS),
        "feel_bad": rng.choice(g.BAD_FEELINGS),
        "name2": rng.choice([n for n in g.NAMES if n != name]),
        "animal2": rng.choice([a for a in g.ANIMALS if a != hero]),
        "fadj": rng.choice(g.CHARACTER_ADJECTIVES),
    }
    plan = [g.OPENING_ALONE, g.HOME] if rng.random() < 0.5 else [g.OPENING_WITH_HOME]
    plan += [g.HABIT, g.FIND, g.FEEL, *g.ARCS[rng.choice(sorted(g.ARCS))], g.ENDING, g.THE_END]
    return " ".join(rng.choice(stage).fill(values) for stage in plan)


def random_topic(rng: random.Random) -> Topic:
    """An animal, a place or a thing, each kind equally likely."""
    kind: TopicKind = rng.choice(("animal", "place", "thing"))
    words = {"animal": g.ANIMALS, "place": g.PLACES, "thing": g.THINGS}[kind]
    return Topic(kind, rng.choice(words))


def story_about(rng: random.Random, topic: Topic) -> str:
    """A story in which `topic.word` plays the role its kind names."""
    return story(rng, **{topic.kind: topic.word})


def chat(rng: random.Random) -> list[dict[str, str]]:
    """One ChatML exchange: mostly a request for a story about a topic, and its story."""
    messages: list[dict[str, str]] = []
    if rng.random() < 0.2:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    roll = rng.random()
    if roll < 0.86:
        topic = random_topic(rng)
        request = rng.choice(STORY_REQUESTS).format(x=topic.phrase(rng))
        answer = story_about(rng, topic)
    elif roll < 0.96:
        request = rng.choice(ANY_STORY_REQUESTS)
        answer = story(rng)
    else:
        request = rng.choice(GREETINGS)
        answer = " ".join(t.text for t in g.GREETING)
    messages.append({"role": "user", "content": request})
    messages.append({"role": "assistant", "content": answer})
    return messages


def render_chat(messages: list[dict[str, str]], *, add_generation_prompt: bool = False) -> str:
    """What `CHAT_TEMPLATE` renders for `messages`, written out in Python."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def document(rng: random.Random, chat_share: float = 0.5) -> str:
    """One training document, ending with `<|endoftext|>`: a chat with probability `chat_share`,
    else a plain story."""
    if rng.random() < 1.0 - chat_share:
        return story(rng) + END_OF_TEXT
    return render_chat(chat(rng)) + END_OF_TEXT


def documents(seed: int, chat_share: float = 0.5) -> Iterator[str]:
    """The endless corpus for `seed`: the same seed always gives the same documents."""
    rng = random.Random(seed)
    while True:
        yield document(rng, chat_share)
