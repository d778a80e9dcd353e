"""What the load generator sends: request bodies, made from a seeded RNG.

Pure (no I/O); one seed gives the same requests on every server, so two systems are
measured on the same work.

- ``completions`` with **token-id prompts**, ``prompt`` a list of ids, so its length
  is exact whatever the tokenizer. By default (``word_ids``) the ids are those of
  common English words (:data:`WORDS`, each as the server's ``/tokenize`` split it,
  ``client.word_ids``): the prompt is ordinary text, cut at the asked length, and so
  is a greedy answer to it. With random ids from ``token_ids`` instead (``--prompt-kind
  ids``; 20-255 are ids every byte-level or byte-fallback vocabulary has, above the
  special tokens small vocabularies put first, SmolLM2's 0-16) the prompt is bytes
  and greedy answers are rare CJK characters of 3 byte-tokens each, which servers
  send as one chunk: the per-chunk gaps then measure the UTF-8 flushing, not the
  engine (``stats.py``'s ITL).
- ``chat``: the OpenAI chat API takes text only, so a prompt of N "tokens" is N short
  common words; the server's ``usage.prompt_tokens`` says what it made of them.
- **Mixed lengths**: a length written ``LO-HI`` is drawn uniformly per request.
- **Multi-turn**: a conversation of ``turns`` user turns; each turn sends the whole
  history (earlier questions and the answers the server streamed) plus a new
  question, so the prompt grows turn by turn and a prefix cache has something to hit.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass
from typing import Any

from triollm.errors import UserError


class Api(enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"

    @property
    def path(self) -> str:
        return "/v1/completions" if self is Api.COMPLETIONS else "/v1/chat/completions"


@dataclass(frozen=True)
class Span:
    """A length: fixed (``lo == hi``) or drawn uniformly from ``lo..hi`` per request."""

    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str, flag: str, *, minimum: int = 1) -> Span:
        lo_s, sep, hi_s = text.partition("-")
        try:
            lo, hi = int(lo_s), int(hi_s if sep else lo_s)
        except ValueError:
            raise UserError(f"{flag}: expected N or LO-HI, got {text!r}") from None
        if lo < minimum or hi < lo:
            raise UserError(f"{flag}: need {minimum} <= LO <= HI, got {text!r}")
        return cls(lo, hi)

    @property
    def mixed(self) -> bool:
        return self.hi != self.lo

    def draw(self, rng: random.Random) -> int:
        return self.lo if self.lo == self.hi else rng.randint(self.lo, self.hi)

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}-{self.hi}"


# Short common words; BPE vocabularies hold most as one token each (with the leading
# space). The chat prompt of N words is only approximately N tokens (usage says how
# many); a completions prompt is made of their ids, cut at exactly N (client.word_ids).
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "it",
    "for",
    "on",
    "with",
    "as",
    "at",
    "by",
    "from",
    "this",
    "that",
    "be",
    "are",
    "was",
    "or",
    "an",
    "not",
    "but",
    "all",
    "can",
    "one",
    "more",
    "time",
    "day",
    "way",
    "man",
    "new",
    "year",
    "work",
    "part",
    "place",
    "case",
    "week",
    "world",
]


@dataclass(frozen=True)
class Workload:
    api: Api
    model: str
    prompt_tokens: Span
    max_tokens: Span
    token_ids: Span = Span(20, 255)
    turns: int = 0  # 0: independent requests; N >= 1: conversations of N turns
    # Every request produces max_tokens. Not the same rule on both servers: llama-server
    # bans the end-of-generation tokens (a -inf logit bias, server-schema.cpp), so greedy
    # takes the next best; triollm, as vLLM, only does not stop on them, so EOS can
    # still be sampled (a token without text) and the answer goes on. Either way the
    # count is max_tokens, which client.check_usage holds every request to.
    ignore_eos: bool = True
    # Each word of WORDS as the server tokenizes it (client.word_ids); empty: the
    # completions prompt is random ids from token_ids.
    word_ids: tuple[tuple[int, ...], ...] = ()
    # llama-server's field: every chunk carries timings.predicted_n, the tokens so far,
    # so the client knows how many tokens each chunk carried. Servers without it
    # ignore it. Off: the A/B of what asking costs.
    timings_per_token: bool = True
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.turns and self.api is not Api.CHAT:
            raise UserError("--turns needs --api chat (a conversation is a list of messages)")
        if self.turns < 0:
            raise UserError(f"--turns must be >= 0, got {self.turns}")


@dataclass(frozen=True)
class Request:
    """One request to send: its body, what the client expects back, its place."""

    body: dict[str, Any]
    prompt_ids: tuple[int, ...] | None  # what usage.prompt_tokens must count, if known
    max_tokens: int
    turn: int = 0


def _common(w: Workload, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": w.model,
        "max_tokens": max_tokens,
        "temperature": w.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if w.ignore_eos:
        body["ignore_eos"] = True
    if w.timings_per_token:
        body["timings_per_token"] = True
    return body


def completion_request(w: Workload, rng: random.Random) -> Request:
    """A completions request whose prompt is ``prompt_tokens`` token ids: random words'
    ids (``word_ids``), cut at that length, or random ids from ``token_ids``."""
    n = w.prompt_tokens.draw(rng)
    if w.word_ids:
        words: list[int] = []
        while len(words) < n:
            words += rng.choice(w.word_ids)
        ids = tuple(words[:n])
    else:
        ids = tuple(rng.randint(w.token_ids.lo, w.token_ids.hi) for _ in range(n))
    max_tokens = w.max_tokens.draw(rng)
    return Request(_common(w, max_tokens) | {"prompt": list(ids)}, ids, max_tokens)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def chat_request(
    w: Workload, history: list[dict[str, str]], turn: int, rng: random.Random
) -> Request:
    """A chat request: ``history`` plus a new user message of ~``prompt_tokens`` words."""
    messages = [*history, {"role": "user", "content": words(rng, w.prompt_tokens.draw(rng))}]
    max_tokens = w.max_tokens.draw(rng)
    return Request(_common(w, max_tokens) | {"messages": messages}, None, max_tokens, turn)


class Conversation:
    """A multi-turn chat: ``next_request`` then ``answered`` with what came back.

    Not shared between tasks: each closed-loop worker owns the one it is having.
    """

    def __init__(self, w: Workload, rng: random.Random) -> None:
        self.w, self.rng = w, rng
        self.history: list[dict[str, str]] = []
        self.turn = 0

    @property
    def finished(self) -> bool:
        return self.turn >= self.w.turns

    def next_request(self) -> Request:
        self.turn += 1
        req = chat_request(self.w, self.history, self.turn, self.rng)
        self.history = list(req.body["messages"])
        return req

    def answered(self, text: str) -> None:
        self.history.append({"role": "assistant", "content": text})


class Source:
    """Hands out requests in a fixed order from one seed (one per level)."""

    def __init__(self, w: Workload, level_seed: int) -> None:
        self.w = w
        self.rng = random.Random(f"{w.seed}/{level_seed}")

    def single(self) -> Request:
        if self.w.api is Api.COMPLETIONS:
            return completion_request(self.w, self.rng)
        return chat_request(self.w, [], 0, self.rng)

    def conversation(self) -> Conversation:
        # Each conversation gets its own RNG so its words do not depend on how
        # the other workers' turns interleave.
        return Conversation(self.w, random.Random(self.rng.random()))
