"""The story grammar the demo model is trained on: its words, its sentence templates, a parser.

Every sentence the corpus generator writes is one `Template` with its `{slot}` placeholders
filled from `SLOTS`; nothing else ever appears in the corpus. That makes the grammar a checkable
claim about the model too: `parse_sentence` accepts exactly the sentences some template can
produce (a slot that appears twice in one template must hold the same word both times), and
`unknown_words` names any word the grammar never uses. The acceptance tests run the model's
greedy output through both.

The words are plain English that a child's picture book would use; they were chosen for this
project and no sentence is taken from any dataset or book.

Caller's trap: the parser checks one sentence at a time. Agreement across sentences (the hero's
name, the object found in one sentence and lost in the next) is the generator's promise, which
`parse_story` reports as slot values for a caller to compare, not something it enforces.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

# --- the words ------------------------------------------------------------------------------

HE_NAMES = ("Tom", "Max", "Ben", "Sam", "Leo", "Jack", "Tim", "Finn", "Oscar", "Hugo")
SHE_NAMES = ("Lily", "Mia", "Anna", "Lucy", "Emma", "Sara", "Rosa", "Ella", "Nina", "Zoe")
NAMES = HE_NAMES + SHE_NAMES

# (a, an) is decided by `article`; every adjective that stands before a noun starts with a
# consonant so that "a" is always right there and the templates can spell it out.
ANIMALS = (
    "fox", "rabbit", "bear", "cat", "dog", "owl", "duck", "mouse", "frog", "bird", "turtle",
    "squirrel", "deer", "lion", "pig", "goat", "horse", "hen", "wolf", "bee", "puppy", "kitten",
    "elephant", "tiger",
)  # fmt: skip
PLACES = (
    "forest", "river", "meadow", "garden", "village", "farm", "mountain", "beach", "lake",
    "park", "castle", "hill", "pond", "cave", "island", "valley", "sea", "field",
)  # fmt: skip
THINGS = (
    "ball", "box", "key", "hat", "kite", "book", "shell", "stone", "cup", "map", "bell", "drum",
    "boat", "flower", "apple", "star", "feather", "ring", "lamp", "blanket", "basket", "umbrella",
)  # fmt: skip
CHARACTER_ADJECTIVES = (
    "little", "small", "big", "kind", "happy", "clever", "shy", "brave", "gentle", "curious",
    "friendly", "tiny", "young", "funny",
)  # fmt: skip
THING_ADJECTIVES = (
    "red", "blue", "green", "yellow", "shiny", "big", "tiny", "golden", "soft", "pretty",
    "strange", "magic", "small",
)  # fmt: skip
HOMES = ("house", "den", "nest", "cottage", "burrow", "barn")
HOME_ADJECTIVES = ("small", "cozy", "warm", "quiet", "little")
SPOTS = (
    "under a tree", "behind a rock", "in the grass", "near the water", "by the old fence",
    "under the bridge", "inside a hollow log", "on the path",
)  # fmt: skip
# (present, past) pairs: the habit sentence uses the first, the happy ending the second.
HOBBIES = (
    ("play", "played"), ("run", "ran"), ("sing songs", "sang songs"), ("dance", "danced"),
    ("jump", "jumped"), ("swim", "swam"), ("draw pictures", "drew pictures"),
    ("read books", "read books"), ("climb trees", "climbed trees"),
    ("pick flowers", "picked flowers"), ("play games", "played games"),
    ("look at the clouds", "looked at the clouds"), ("bake cakes", "baked cakes"),
    ("explore", "explored"),
)  # fmt: skip
FIND_FEELINGS = ("surprised", "curious", "excited", "happy", "amazed")
GOOD_FEELINGS = ("happy", "proud", "glad", "calm", "cheerful", "thankful")
BAD_FEELINGS = ("sad", "scared", "lonely", "worried", "upset")
PRONOUNS = {"he": ("he", "He", "his", "His"), "she": ("she", "She", "her", "Her")}

SLOTS: dict[str, tuple[str, ...]] = {
    "name": NAMES,
    "name2": NAMES,
    "he": ("he", "she"),
    "He": ("He", "She"),
    "his": ("his", "her"),
    "animal": ANIMALS,
    "animal2": ANIMALS,
    "cadj": CHARACTER_ADJECTIVES,
    "fadj": CHARACTER_ADJECTIVES,
    "place": PLACES,
    "home": HOMES,
    "hadj": HOME_ADJECTIVES,
    "thing": THINGS,
    "tadj": THING_ADJECTIVES,
    "spot": SPOTS,
    "spot2": SPOTS,
    "hobby": tuple(present for present, _ in HOBBIES),
    "hobby_past": tuple(past for _, past in HOBBIES),
    "feel_find": FIND_FEELINGS,
    "feel_good": GOOD_FEELINGS,
    "feel_bad": BAD_FEELINGS,
}


def article(word: str) -> str:
    """The indefinite article for `word` ("an owl", "a fox")."""
    return "an" if word[0] in "aeiou" else "a"


def pronouns_for(name: str) -> dict[str, str]:
    """The pronoun slot values (he/He/his) that go with one of `NAMES`."""
    he, cap_he, his, _ = PRONOUNS["he" if name in HE_NAMES else "she"]
    return {"he": he, "He": cap_he, "his": his}


# --- the templates --------------------------------------------------------------------------


@dataclass(frozen=True)
class Template:
    """One sentence shape: literal text with `{slot}` placeholders named in `SLOTS`."""

    stage: str
    text: str

    def fill(self, values: Mapping[str, str]) -> str:
        """The sentence with every slot replaced; a missing slot value raises KeyError."""
        return self.text.format_map(values)

    def slots(self) -> tuple[str, ...]:
        """The distinct slot names in order of first appearance."""
        seen: dict[str, None] = {}
        for slot in re.findall(r"\{(\w+)\}", self.text):
            seen.setdefault(slot)
        return tuple(seen)


def _t(stage: str, *texts: str) -> tuple[Template, ...]:
    return tuple(Template(stage, text) for text in texts)


# A story is: OPENING, HOME (unless the opening already said where the hero lives), HABIT,
# FIND, FEEL, one ARC (a list of stages), ENDING, "The end." The order never changes: a small
# model learns a fixed plot much faster than a free one, and the demo only has to be readable.
OPENING_ALONE = _t(
    "opening",
    "Once upon a time, there was a {cadj} {animal} named {name}.",
)
OPENING_WITH_HOME = _t(
    "opening",
    "Once upon a time, there was a {cadj} {animal} named {name} who lived near the {place}.",
    "Once upon a time, in a {hadj} {home} near the {place}, there lived a {cadj} {animal} "
    "named {name}.",
)
HOME = _t(
    "home",
    "{name} lived in a {hadj} {home} near the {place}.",
    "{name} lived by the {place}.",
    "{He} lived near the {place} with {his} family.",
)
HABIT = _t(
    "habit",
    "Every day, {he} liked to {hobby}.",
    "{He} loved to {hobby} with {his} friends.",
    "{name} liked to {hobby} more than anything.",
)
FIND = _t(
    "find",
    "One day, {name} found a {tadj} {thing} {spot}.",
    "One sunny morning, {name} saw a {tadj} {thing} {spot}.",
    "One day, while {he} was playing near the {place}, {he} found a {tadj} {thing} {spot}.",
)
FEEL = _t(
    "feel",
    "{He} felt very {feel_find}.",
    "{name} was so {feel_find}!",
    "{name} picked up the {thing} and smiled.",
)
FRIEND_MEET = _t(
    "friend",
    "Then {name} met a {fadj} {animal2} named {name2}.",
    "Soon, a {fadj} {animal2} named {name2} came by.",
)
FRIEND_TALK = _t(
    "friend",
    '{name2} said, "What a nice {thing}!"',
    '{name2} asked, "Can I play with you?"',
    '{name2} said, "Let us play together!"',
)
FRIEND_END = _t(
    "friend",
    "Together, they {hobby_past} all day long.",
    "{name} and {name2} became best friends.",
)
LOSS_EVENT = _t(
    "loss",
    "But then, a strong wind blew the {thing} away.",
    "But then, {name} lost the {thing} near the {place}.",
)
LOSS_FEEL = _t(
    "loss",
    "{He} felt {feel_bad}.",
    "{name} was very {feel_bad}.",
)
LOSS_SEARCH = _t(
    "loss",
    "{name} looked everywhere for the {thing}.",
)
LOSS_FOUND = _t(
    "loss",
    "At last, {he} found it {spot2}.",
)
RAIN_START = _t(
    "rain",
    "Suddenly, dark clouds came and it started to rain.",
    "Suddenly, the sky turned gray and the rain began to fall.",
)
RAIN_HOME = _t(
    "rain",
    "{name} held the {thing} close and ran home.",
)
RAIN_WAIT = _t(
    "rain",
    "At home, {he} {hobby_past} until the sun came out again.",
)
ENDING = _t(
    "ending",
    "In the end, {name} was very {feel_good}.",
    "From that day on, {name} always kept the {thing} close.",
    "{name} went home {feel_good} and tired.",
)
THE_END = _t("the_end", "The end.")
# What the assistant says when the user does not ask for a story at all.
GREETING = _t(
    "greeting",
    "Hello!",
    "I am a tiny demo model.",
    "I can tell short stories.",
    "Ask me for a story about an animal, a place or a thing.",
)

ARCS: dict[str, tuple[tuple[Template, ...], ...]] = {
    "friend": (FRIEND_MEET, FRIEND_TALK, FRIEND_END),
    "loss": (LOSS_EVENT, LOSS_FEEL, LOSS_SEARCH, LOSS_FOUND),
    "rain": (RAIN_START, RAIN_HOME, RAIN_WAIT),
}

TEMPLATES: tuple[Template, ...] = (
    OPENING_ALONE
    + OPENING_WITH_HOME
    + HOME
    + HABIT
    + FIND
    + FEEL
    + tuple(t for stages in ARCS.values() for stage in stages for t in stage)
    + ENDING
    + THE_END
    + GREETING
)


# --- parsing --------------------------------------------------------------------------------


def _alternatives(words: tuple[str, ...]) -> str:
    # Longest first, so "sing songs" is tried before a shorter word that is its prefix.
    return "|".join(re.escape(w) for w in sorted(set(words), key=len, reverse=True))


def _compile(template: Template) -> re.Pattern[str]:
    parts: list[str] = []
    seen: set[str] = set()
    for literal, slot in re.findall(r"([^{]*)(?:\{(\w+)\})?", template.text):
        parts.append(re.escape(literal))
        if not slot:
            continue
        if slot in seen:
            parts.append(f"(?P={slot})")  # the same slot twice holds the same words
        else:
            seen.add(slot)
            parts.append(f"(?P<{slot}>{_alternatives(SLOTS[slot])})")
    return re.compile("".join(parts))


@functools.cache
def _compiled() -> tuple[tuple[Template, re.Pattern[str]], ...]:
    return tuple((t, _compile(t)) for t in TEMPLATES)


@dataclass(frozen=True)
class ParsedSentence:
    """A sentence the grammar accepts: which template made it and what each slot held."""

    template: Template
    values: dict[str, str]


def parse_sentence(sentence: str) -> ParsedSentence | None:
    """The template that produces exactly `sentence` (no surrounding spaces), or None."""
    for template, pattern in _compiled():
        match = pattern.fullmatch(sentence)
        if match:
            return ParsedSentence(template, match.groupdict())
    return None


# A sentence ends at . ! or ? and takes a closing quote with it; the quotes in the templates
# never hold more than one sentence, so this split cannot cut a quote in half.
_SENTENCE = re.compile(r'[^.!?]+[.!?]"?')


def split_sentences(text: str) -> tuple[list[str], str]:
    """Complete sentences of `text` (stripped), and the unfinished tail after the last one."""
    sentences: list[str] = []
    last_end = 0
    for match in _SENTENCE.finditer(text):
        sentences.append(match.group(0).strip())
        last_end = match.end()
    return sentences, text[last_end:].strip()


def parse_story(text: str) -> list[ParsedSentence]:
    """Parse every complete sentence of `text`; raise ValueError naming the first bad one.

    Text after the last full stop (an answer cut short by max_tokens) must be empty: a caller
    that expects a cut-off answer should split it off with `split_sentences` first.
    """
    sentences, tail = split_sentences(text)
    if tail:
        raise ValueError(f"unfinished sentence at the end: {tail!r}")
    parsed = []
    for sentence in sentences:
        result = parse_sentence(sentence)
        if result is None:
            raise ValueError(f"sentence not in the grammar: {sentence!r}")
        parsed.append(result)
    return parsed


@functools.cache
def vocabulary() -> frozenset[str]:
    """Every word (letters only, case kept) that any template or slot value contains."""
    words: set[str] = set()
    for template in TEMPLATES:
        words.update(re.findall(r"[A-Za-z]+", re.sub(r"\{\w+\}", " ", template.text)))
    for values in SLOTS.values():
        for value in values:
            words.update(re.findall(r"[A-Za-z]+", value))
    return frozenset(words)


def unknown_words(text: str) -> set[str]:
    """Words in `text` that the grammar never uses (empty for any generated story)."""
    return {w for w in re.findall(r"[A-Za-z]+", text) if w not in vocabulary()}


def sentence_count(template: Template) -> int:
    """How many distinct sentences one template can produce (pronoun slots tied to names)."""
    slots = [s for s in template.slots() if s not in ("he", "He", "his")]
    count = math.prod(len(set(SLOTS[s])) for s in slots)
    if "name" not in slots and any(s in ("he", "He", "his") for s in template.slots()):
        count *= 2  # the pronoun is free when the name is not in the same sentence
    return count


def distinct_sentences() -> int:
    """How many distinct sentences the whole grammar can produce."""
    return sum(sentence_count(t) for t in TEMPLATES)
