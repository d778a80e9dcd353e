"""Fixtures for the integration tests (helpers live in serverkit.py)."""

from __future__ import annotations

from typing import Any

import pytest
from serverkit import MODEL_DIR


@pytest.fixture(scope="session")
def loaded() -> Any:
    """The smallest fixture checkpoint, loaded once per session."""
    if not (MODEL_DIR / "config.json").exists():
        pytest.skip(f"fixture model missing: {MODEL_DIR}")
    from triollm.model.loader import load_model

    return load_model(MODEL_DIR)
