"""Every picture in docs/img is shown by a page, and every picture a page shows exists.

The pictures are drawn by code (``tools/figures.py``, ``triollm simulate --html`` plus
a screenshot, the benchmark plots): a picture no page shows is dead weight, and one that
a page shows but nobody drew is a broken promise (mkdocs also refuses it).
"""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
SHOWN = re.compile(r"!\[[^\]]*\]\((img/[^)\s]+)\)")


def _shown() -> set[str]:
    return {m for page in DOCS.glob("*.md") for m in SHOWN.findall(page.read_text())}


def test_every_picture_in_docs_img_is_shown_by_a_page() -> None:
    pictures = {f"img/{p.name}" for p in (DOCS / "img").glob("*.png")}
    assert pictures, "docs/img has no pictures"
    assert pictures - _shown() == set()


def test_every_picture_a_page_shows_exists_and_is_not_empty() -> None:
    for name in _shown():
        assert (DOCS / name).stat().st_size > 5_000, name
