"""The fixture checkpoints under tests/fixtures/models, each loaded once per process.

Loading a checkpoint (and its numba warm-up) is the slow part of the model tests;
every test module that runs the fixture models shares this one cache.
"""

from __future__ import annotations

import functools
from pathlib import Path

from triollm.model.loader import LoadedModel, load_model

MODELS = Path(__file__).resolve().parent.parent / "fixtures" / "models"


@functools.cache
def loaded(name: str) -> LoadedModel:
    """The fixture model ``name``, loaded on first use."""
    return load_model(MODELS / name)
