"""Tokenizing bounded by what can fit, and done without holding the GIL (issue 28, N3).

The pre-check counts the whole rendering (every message, name, tool and template
variable: what the template wrote) in bytes, over the most bytes one token of this
vocabulary stands for; past the limit, the text is refused without being tokenized.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from triollm.errors import FieldError
from triollm.model import tokenizer as tokenizer_module
from triollm.model.tokenizer import Tokenizer, TooManyTokens, _normalizer_bound

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "qwen2-bias-f32"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(FIXTURE)


def test_the_bound_never_exceeds_the_real_count(tok):
    texts = [
        "Hello, world.",
        " " * 5000,
        "=" * 3000 + "\n" * 300,
        "日本語のテキスト" * 200,
        "<|im_start|>user\nhi<|im_end|>" * 50,
        "".join(chr(c) for c in range(32, 3000)),
    ]
    for text in texts:
        assert tok.at_least_tokens(text) <= len(tok.encode(text, add_special_tokens=False))


def test_many_empty_messages_are_counted_and_refused_before_tokenizing(tok, monkeypatch):
    # Empty contents: the old pre-check counted 0 characters, but the template writes
    # a turn header per message; 5,000 of them are far past a 256-token context.
    messages = [{"role": "user", "content": ""}] * 5000

    def no_tokenizing(*args: object, **kwargs: object) -> None:
        raise AssertionError("tokenized a text that cannot fit")

    monkeypatch.setattr(tokenizer_module, "_encode", no_tokenizing)
    with pytest.raises(TooManyTokens) as info:
        tok.encode_chat(messages, limit=256)
    assert info.value.limit == 256 and info.value.at_least > 256
    assert "256 tokens" in str(info.value)


# A Qwen-style template that writes the tools into the system turn.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


def test_tools_count_against_the_context_too(tmp_path, monkeypatch):
    for f in FIXTURE.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    tok = Tokenizer.from_dir(tmp_path)
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "description": "d" * 200}}
        for i in range(200)
    ]
    monkeypatch.setattr(tokenizer_module, "_encode", None)  # must not be reached
    with pytest.raises(TooManyTokens):
        tok.encode_chat([{"role": "user", "content": "hi"}], tools=tools, limit=256)


def test_a_prompt_that_fits_is_tokenized_as_before(tok):
    text = "The quick brown fox " * 10
    assert tok.encode(text, limit=256) == tok.encode(text)


def test_tokenizing_lets_other_threads_run():
    # tokenizers' encode() holds the GIL for the whole call, so a long prompt froze the
    # event loop (N3). No timing: the interpreter's forced GIL switches are turned off
    # (a 100 s switch interval), so this thread can run while the other one tokenizes
    # only if the tokenizer drops the GIL itself.
    tok = Tokenizer.from_dir(FIXTURE)
    text = "Hello world, this is an ordinary sentence with some words. " * 5000
    started = threading.Event()
    done = threading.Event()

    def work() -> None:
        started.set()
        tok.encode(text)
        done.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        thread = threading.Thread(target=work)
        thread.start()
        started.wait()
        turns = 0
        while not done.is_set() and turns < 1000:
            turns += 1
        done.wait()
        thread.join()
    finally:
        sys.setswitchinterval(old)
    assert turns == 1000  # held: 0 (this thread ran only once the encode was over)


def test_normalizers_that_may_shrink_text_get_their_form_or_a_margin():
    assert _normalizer_bound(None) == (None, 1)
    assert _normalizer_bound({"type": "NFC"}) == ("NFC", 1)
    assert _normalizer_bound({"type": "Lowercase"}) == (None, 2)
    space = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    assert _normalizer_bound({"type": "Sequence", "normalizers": [space, {"type": "NFKC"}]}) == (
        "NFKC",
        1,
    )


@pytest.mark.parametrize("name", ["self", "raise_exception", "range", "namespace", "loop"])
def test_a_template_variable_that_names_a_helper_or_a_reserved_word_is_the_clients_error(tok, name):
    # Each was a 500 (chat_template_error) that blamed the server's configuration (N4).
    with pytest.raises(FieldError) as info:
        tok.encode_chat([{"role": "user", "content": "hi"}], template_kwargs={name: 1})
    assert info.value.field == "chat_template_kwargs"
    assert f"'chat_template_kwargs.{name}'" in str(info.value)


def test_a_template_variable_of_its_own_still_reaches_the_template(tok):
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert (
        tok.apply_chat_template(
            [{"role": "user", "content": "hi"}], template_kwargs={"enable_thinking": False}
        )
        == plain
    )
