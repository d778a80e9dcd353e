"""Record transformers' greedy answers from the SmolLM2 Q4_1 GGUF, for the greedy test.

    python tools/make_gguf_reference.py     (needs the `fixtures` extra: torch, transformers)

transformers' GGUF loader (``from_pretrained(dir, gguf_file=...)``) dequantizes
the same file to float32 and runs its own Llama; this records, for a few chat
prompts, the prompt ids (the chat template rendered and tokenized by
transformers' tokenizer built from the same file), the greedy continuation up
to EOS or ``MAX_NEW`` tokens, and at every generated position the gap between
the top two logits: a small gap is where float32 rounding could flip the
argmax, so the test can say how close each call was.

Trap: this model's ``pad_token_id`` is ``<|im_end|>``, which the chat
template also writes between turns; without an explicit ``attention_mask``,
transformers infers one from the pad id and masks those positions out. The
mask is passed, all ones.

Output: ``tests/fixtures/gguf/smollm2-q4_1-greedy.json`` (a few KB).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from smollm2 import SPEC, fetch  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "gguf" / "smollm2-q4_1-greedy.json"
MAX_NEW = 24
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a CPU does.",
    "List three colors of the rainbow.",
    "Translate 'good morning' into Spanish.",
    "def add(a, b):\n    # complete this Python function",
]


def main() -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = fetch()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    model.eval()
    eos = model.generation_config.eos_token_id
    records = []
    for text in PROMPTS:
        messages = [{"role": "user", "content": text}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        ids = [int(i) for i in ids]
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=eos,
            )
        new = [int(t) for t in out.sequences[0, len(ids) :]]
        gaps = []
        for scores in out.scores:
            top = torch.topk(scores[0].float(), 2).values
            gaps.append(round(float(top[0] - top[1]), 5))
        records.append(
            {
                "prompt": text,
                "prompt_ids": ids,
                "greedy_ids": new,
                "text": tok.decode(new, skip_special_tokens=True),
                "gaps": gaps,
                "min_gap": min(gaps),
            }
        )
        print(f"{text!r} -> {records[-1]['text']!r} (min gap {min(gaps):.4f})")
    summary = {
        "model": SPEC,
        "file": path.name,
        "reference": "transformers GGUF loader, float32, greedy, explicit attention_mask",
        "max_new_tokens": MAX_NEW,
        "records": records,
    }
    OUT.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
