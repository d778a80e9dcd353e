"""Shared pieces of the translated APIs' client tests (Responses, Messages, Ollama).

The fixture model is random: it calls a tool only when a tool choice forces it, and
its text is nonsense, so each test compares an API's answer with what
/v1/chat/completions answers for the same conversation at temperature 0 (one path
below the edge: the same greedy tokens), and checks tool calls against their schema.

``hermes_model`` gives the fixture a Hermes-style chat template (Qwen's tool syntax),
kept short for the fixture's 512 positions, so the server reads its tool-call format
from the template as it does for Qwen.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
from serverkit import MODEL_DIR

HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
tools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>
{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
# The same tool in OpenAI's chat spelling (the reference every API translates onto)
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    }
]
ASK = "What is the weather in Paris?"


def hermes_model(directory: Path) -> Any:
    """The fixture model with the Hermes template, loaded from ``directory``."""
    from triollm.model.loader import load_model

    for f in MODEL_DIR.iterdir():
        if f.name != "tokenizer_config.json":
            (directory / f.name).symlink_to(f)
    cfg = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(
        json.dumps({**cfg, "chat_template": HERMES_TEMPLATE})
    )
    return load_model(directory)


async def chat(url: str, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """/v1/chat/completions' answer, at temperature 0 unless told."""
    body = {"messages": messages, "temperature": 0, **fields}
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        r = await http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def prompt_tokens(url: str, messages: list[dict[str, Any]], **fields: Any) -> int:
    """How many tokens the chat template makes of ``messages`` (``/tokenize``)."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        r = await http.post("/tokenize", json={"messages": messages, **fields})
    assert r.status_code == 200, r.text
    return int(r.json()["count"])
