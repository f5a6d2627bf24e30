"""The runnable examples of docs/ pages run as written (the README's are run by test_readme.py)."""

import subprocess
import sys
from pathlib import Path

import pytest
from test_readme import runnable_blocks

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["docs/custom-policy.md"]


@pytest.mark.model
@pytest.mark.parametrize("page", PAGES)
def test_the_pages_runnable_blocks_run(page, tmp_path):
    blocks = runnable_blocks((ROOT / page).read_text())
    assert blocks, f"{page} has no runnable block"
    for block in blocks:
        assert block.language == "python"
        done = subprocess.run([sys.executable, "-c", block.code], cwd=tmp_path, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, f"{page} line {block.line}:\n{done.stderr[-3000:]}"
        if page == "docs/custom-policy.md":
            assert "expected:" in done.stdout and "bytes kept: 50%" in done.stdout, done.stdout
