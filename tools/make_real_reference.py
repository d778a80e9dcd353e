"""Record transformers' greedy answers from a real GGUF (``tools/real_files.py``).

    python tools/make_real_reference.py [NAME]   (needs the `fixtures` extra: torch, transformers)

``NAME`` is one of ``tools/real_files.py``'s files: ``qwen2.5-coder-0.5b-instruct-q4_k_m``
(the default; chat prompts and a tool call, ``CASES``), ``smollm2-q4_1`` (six chat
prompts, ``SMOLLM2_CASES``) or ``gemma3-270m``, a base model with no chat template,
continued from plain-text prompts (``COMPLETIONS``; each record's ``prompt`` is the
prompt, ``text`` the continuation).

transformers' GGUF loader (``from_pretrained(dir, gguf_file=...)``) dequantizes the
same file to float32 and runs its own model; this records, for a few chat prompts
and one tool-calling conversation (or the completion prompts):

- the prompt ids (the file's chat template rendered and tokenized by transformers'
  tokenizer built from the same file; the tool prompt with ``tools=``);
- the greedy continuation up to EOS or ``max_new`` tokens;
- at every generated position the gap between the top two logits (a small gap is
  where float32 rounding could flip the argmax; the test reports it).

Trap: the attention mask is passed (all ones). transformers would otherwise infer one
from ``pad_token_id``, and SmolLM2's pad id is ``<|im_end|>``, the token its chat
template writes between turns: those positions would be masked out.

Output: ``tests/fixtures/gguf/<NAME>-greedy.json`` (a few KB; the model itself stays in
``~/.cache/triollm/models``, never in the repository).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "tests" / "fixtures" / "gguf"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city's name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}

COMPLETIONS: list[dict[str, Any]] = [
    {"text": "The capital of France is", "max_new": 24},
    {"text": "def fibonacci(n):\n", "max_new": 32},
    {"text": "Once upon a time, in a small village by the sea,", "max_new": 32},
    {"text": "The three primary colors are", "max_new": 24},
]

SMOLLM2_CASES: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": text}], "max_new": 24}
    for text in (
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain in one sentence what a CPU does.",
        "List three colors of the rainbow.",
        "Translate 'good morning' into Spanish.",
        "def add(a, b):\n    # complete this Python function",
    )
]

CASES: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_new": 24},
    {
        "messages": [
            {"role": "user", "content": "Write a Python function that reverses a string."}
        ],
        "max_new": 32,
    },
    {
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Explain in one sentence what a mutex is."},
        ],
        "max_new": 24,
    },
    {
        "messages": [{"role": "user", "content": "What is the weather in Paris right now?"}],
        "tools": [WEATHER_TOOL],
        "max_new": 48,
    },
]


def main() -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(ROOT / "tools"))
    from real_files import real_file

    name = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-0.5b-instruct-q4_k_m"
    f = real_file(name)
    path = f.fetch()
    sha = f.sha256 or hashlib.sha256(path.read_bytes()).hexdigest()
    cases = {"gemma3-270m": COMPLETIONS, "smollm2-q4_1": SMOLLM2_CASES}.get(name, CASES)
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    model.eval()
    eos = model.generation_config.eos_token_id
    records = []
    for case in cases:
        if "text" in case:  # a base model: the text as the tokenizer encodes it (BOS first)
            ids = tok(case["text"])["input_ids"]
        else:
            ids = tok.apply_chat_template(
                case["messages"],
                tools=case.get("tools"),
                add_generation_prompt=True,
                tokenize=True,
            )
        if hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        ids = [int(i) for i in ids]
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=case["max_new"],
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=eos if isinstance(eos, int) else eos[0],
            )
        new = [int(t) for t in out.sequences[0, len(ids) :]]
        gaps = []
        for scores in out.scores:
            top = torch.topk(scores[0].float(), 2).values
            gaps.append(round(float(top[0] - top[1]), 5))
        records.append(
            {
                **(
                    {"prompt": case["text"], "max_new": case["max_new"]} if "text" in case else case
                ),
                "prompt_ids": ids,
                "greedy_ids": new,
                "text": tok.decode(new, skip_special_tokens=False),
                "gaps": gaps,
                "min_gap": min(gaps),
            }
        )
        asked = case["text"] if "text" in case else case["messages"][-1]["content"]
        print(f"{asked!r} -> {records[-1]['text']!r} (min gap {min(gaps):.4f})")
    summary = {
        "model": name,
        "sha256": sha,
        "reference": "transformers GGUF loader, float32, greedy, explicit attention_mask",
        "records": records,
    }
    out_file = OUT_DIR / f"{name}-greedy.json"
    out_file.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {out_file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
