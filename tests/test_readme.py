"""README.md's runnable examples run as written, on the bundled SmolLM2, with the sizes they show.

A fenced ```bash or ```python block is runnable when the line before its fence is exactly
``<!-- runnable -->``. The blocks run in order, in one temporary folder (later blocks read what
earlier ones wrote, as a reader following the README would): shell blocks with ``bash -euo pipefail``
and the virtualenv's ``bin`` first on ``PATH``, Python blocks with ``python -c``. Files of the
repository that a block names (``results/smollm2-2k.sqlite``) are copied into that folder first, so
the examples read them as from the repository root and nothing is written into the working tree.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvsieve.cli_arguments import build_parser
from kvsieve.evolve.database import ProgramDatabase
from kvsieve.evolve.evolve_config import load_config

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MARKER = "<!-- runnable -->"
MAX_LINES = 300
_FENCE = re.compile(r"^```(\w*)\s*$")
_REPO_PATH = re.compile(r"(?<![\w/.-])((?:results|configs|benchmarks)/[\w./-]+)")


@dataclass
class Block:
    language: str  # "bash" or "python"
    code: str
    line: int  # 1-based line of the opening fence


def runnable_blocks(text: str) -> list[Block]:
    """The blocks marked runnable, in order; a marker not followed by a bash or python fence is an error."""
    lines = text.split("\n")
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != MARKER:
            i += 1
            continue
        fence = _FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if fence is None or fence.group(1) not in ("bash", "python"):
            found = lines[i + 1] if i + 1 < len(lines) else "the end of the file"
            raise ValueError(f"line {i + 1}: {MARKER} must be followed by ```bash or ```python, found {found!r}")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"line {i + 2}: the ```{fence.group(1)} block marked runnable is never closed")
        blocks.append(Block(fence.group(1), "\n".join(lines[i + 2 : end]) + "\n", i + 2))
        i = end + 1
    return blocks


def test_extractor_reads_marked_blocks_only() -> None:
    text = "\n".join([
        "# t", "```bash", "not marked", "```", MARKER, "```bash", "echo a", "echo b", "```",
        "prose", MARKER, "```python", "print(1)", "```",
    ])
    blocks = runnable_blocks(text)
    got = [(b.language, b.code, b.line) for b in blocks]
    assert got == [("bash", "echo a\necho b\n", 6), ("python", "print(1)\n", 12)]


@pytest.mark.parametrize("text, message", [
    (f"{MARKER}\nplain prose\n", "must be followed by ```bash or ```python"),
    (f"{MARKER}\n```toml\na = 1\n```\n", "must be followed by ```bash or ```python"),
    (f"{MARKER}\n```bash\necho never closed\n", "never closed"),
    (f"text\n{MARKER}", "the end of the file"),
])
def test_extractor_rejects_a_stray_marker(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        runnable_blocks(text)


def test_readme_is_short_and_has_runnable_examples() -> None:
    text = README.read_text()
    lines = len(text.splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines (at most {MAX_LINES})"
    blocks = runnable_blocks(text)
    assert {b.language for b in blocks} == {"bash", "python"}
    # every verb the README documents has a runnable example
    shell = "\n".join(b.code for b in blocks if b.language == "bash")
    for verb in ("eval", "report", "evolve", "train", "certify"):
        assert re.search(rf"^kvsieve {verb} ", shell, re.M), f"no runnable `kvsieve {verb}` example"


def test_each_runnable_eval_writes_its_own_store() -> None:
    """An eval prints the report of its whole store: the train block's eval wrote into the Evaluate block's
    my.sqlite, so its table mixed both grids and printed `-` for the learned policies (no row on the other
    block's task)."""
    blocks = runnable_blocks(README.read_text())
    commands = [line for b in blocks if b.language == "bash" for line in b.code.replace("\\\n", " ").split("\n")]
    stores = [m.group(1) for c in commands if (m := re.match(r"kvsieve eval .*--store (\S+)", c.strip()))]
    assert len(stores) >= 2 and len(stores) == len(set(stores)), stores


def _commands(text: str, verb: str) -> list[str]:
    """Every ``kvsieve VERB ...`` the README shows: lines of its bash blocks (marked runnable or not, continuations
    joined, comments cut) and inline code spans."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").split("\n"):
            found.append(line.split(" #")[0].strip())
    found += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))]
    return [c for c in found if c.startswith(f"kvsieve {verb} ")]


def test_each_evolve_the_readme_shows_starts_a_database_it_can_resume(tmp_path: Path) -> None:
    """`kvsieve evolve --config configs/evolve-smollm2.toml` (the Discover section's full run, and with `--executor
    ray` the Scale-out example) resumed the shipped results/evolve/smollm2-structural.sqlite, which this kvsieve
    refuses (scored with version 1 of the program helpers): an example must name a database that runs."""
    commands = _commands(README.read_text(), "evolve")
    assert any("--executor ray" in c for c in commands), commands
    for command in commands:
        args = build_parser().parse_args(shlex.split(command)[1:])
        if not (ROOT / args.config).is_file():  # a config the README writes itself (evolve-tiny.toml)
            continue
        config = load_config(ROOT / args.config, db=args.db, out=args.out)
        if (ROOT / config.db).is_file():
            shutil.copyfile(ROOT / config.db, tmp_path / "db.sqlite")
            db = ProgramDatabase(tmp_path / "db.sqlite")
            try:
                db.check_config(config.identity())
            except ValueError as err:
                pytest.fail(f"README: `{command}` resumes {config.db}, which is refused: {err}")
            finally:
                db.close()


def repository_files(blocks: list[Block]) -> list[str]:
    """Paths under results/, configs/ or benchmarks/ that the blocks name and the repository holds."""
    named = {m.group(1).rstrip(".") for b in blocks for m in _REPO_PATH.finditer(b.code)}
    return sorted(p for p in named if (ROOT / p).is_file())


def test_repository_files_are_found_in_the_code() -> None:
    blocks = [Block("bash", "kvsieve certify --store results/smollm2-2k.sqlite --out x/results/no.json\n", 1),
              Block("bash", "cat configs/evolve-smollm2.toml results/not-there.sqlite\n", 2)]
    assert repository_files(blocks) == ["configs/evolve-smollm2.toml", "results/smollm2-2k.sqlite"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")  # the venv's kvsieve
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.mark.model
def test_readme_examples_run(tmp_path: Path) -> None:
    blocks = runnable_blocks(README.read_text())
    for path in repository_files(blocks):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / path, tmp_path / path)
    for block in blocks:
        if block.language == "bash":
            command = ["bash", "-euo", "pipefail", "-c", block.code]
        else:
            command = [sys.executable, "-c", block.code]
        done = subprocess.run(command, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (
            f"README.md line {block.line} ({block.language}) exited {done.returncode}\n"
            f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
        )
