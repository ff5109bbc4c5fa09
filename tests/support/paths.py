"""Where things are in the checkout, for tests in any folder."""

from __future__ import annotations

from pathlib import Path

__all__ = ["DATA", "DOCS", "REPO"]

REPO = Path(__file__).resolve().parents[2]
#: Captured and hand-written engine pages, with their provenance in SOURCES.md.
DATA = REPO / "tests" / "data"
DOCS = REPO / "docs"
