"""The built-in demo model: a small Llama trained by tools/train_demo.py on our own story grammar.

It ships as package data in `model/` so that `triollm serve` and `triollm generate` have a
model to run on a fresh machine with no download. It is a demo, not a language model: it knows
only the sentences of `triollm.demo.grammar` (see docs/demo-model.md).
"""

from __future__ import annotations

import os
from pathlib import Path

from triollm.errors import UserError


def default_model_dir() -> Path:
    """The directory of the demo checkpoint shipped inside the package (Hugging Face layout).

    Caller's trap: the path lives inside the installed package, so treat it as read-only;
    an editable install points into the source tree, where writing would change the repo.
    """
    return Path(__file__).resolve().parent / "model"


def resolve_model_dir(chosen: str | os.PathLike[str] | None) -> Path:
    """The model directory a command should load: ``chosen``, or the demo checkpoint.

    Shared by ``triollm serve`` and ``triollm generate`` so both say the same thing
    when there is nothing to load. Caller's trap: a chosen directory is returned
    unchecked; the loader names what is wrong with it.
    """
    if chosen is not None:
        if not str(chosen):
            raise UserError("the model directory must not be empty (leave it out for the demo)")
        return Path(chosen)
    path = default_model_dir()
    if not path.is_dir():  # a trimmed install without the package data
        raise UserError(
            f"no MODEL_DIR given and the built-in demo model is missing ({path}); "
            "pass a Hugging Face model directory"
        )
    return path
