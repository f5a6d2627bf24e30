"""docs/reference.md is what docs/make_reference.py writes from the code: every verb's flags, every family's
parameters and the selection fields. A flag or parameter added without regenerating the page fails here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def generated() -> str:
    spec = importlib.util.spec_from_file_location("make_reference", DOCS / "make_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reference()


def test_the_reference_page_matches_the_code():
    text = generated()
    assert "## `kvsieve serve`" in text and "| `tova` | policy |" in text and "`--kv-budget`" in text
    assert (DOCS / "reference.md").read_text() == text, (
        "docs/reference.md is stale: run `python docs/make_reference.py > docs/reference.md`")
