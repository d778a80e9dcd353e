"""The built-in demo model: a small Llama trained by tools/train_demo.py on our own story grammar.

It ships as package data in `model/` so that `triollm serve` and `triollm generate` have a
model to run on a fresh machine with no download. It is a demo, not a language model: it knows
only the sentences of `triollm.demo.grammar` (see docs/demo-model.md).
"""

from __future__ import annotations

from pathlib import Path


def default_model_dir() -> Path:
    """The directory of the demo checkpoint shipped inside the package (Hugging Face layout).

    Caller's trap: the path lives inside the installed package, so treat it as read-only;
    an editable install points into the source tree, where writing would change the repo.
    """
    return Path(__file__).resolve().parent / "model"
