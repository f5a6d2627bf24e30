"""What the LLM mutators share: the prompt (the compact interface described to the model), the reply
parsers (a whole program block, or SEARCH/REPLACE edits) and the counters the search loop logs.

A mutator only produces source text; it never compiles or runs it (the static check and the sandbox
do). A reply that yields no program is counted (``malformed``, or ``failed`` for transport errors)
and ``propose`` returns ``None``: one bad sample must never stop a search.
"""

from __future__ import annotations

import inspect
import re
import textwrap
from collections.abc import Callable, Sequence
from functools import lru_cache

from kvsieve.language import operations
from kvsieve.language import program_features as feats
from kvsieve.language.program_source import SELECTION_CHOICES, SELECTION_RANGES, Program

__all__ = ["EDIT_FORMATS", "DEFAULT_LOCAL_MODEL", "CountingMutator", "ScoreLookup", "check_edit_format",
           "interface_doc", "build_messages", "extract_program", "apply_search_replace"]

EDIT_FORMATS = ("block", "diff")
DEFAULT_LOCAL_MODEL = "qwen2.5-coder-0.5b-instruct"

_SHAPES = {"b": "batch", "h": "KV heads", "g": "query heads per KV head", "n": "cached context entries"}


# --- the prompt -------------------------------------------------------------------------------------


def _field_docs() -> dict[str, str]:
    """Field descriptions parsed from the ``Features`` docstring, so the prompt follows program_features.py."""
    doc = inspect.getdoc(feats.Features) or ""
    _, _, section = doc.partition("Attributes:")
    out: dict[str, str] = {}
    names: list[str] = []
    for line in section.splitlines():
        stripped = line.strip()
        head, sep, rest = stripped.partition(":")
        candidates = [name.strip() for name in head.split(",")]
        if sep and candidates and all(name.isidentifier() for name in candidates):
            names = candidates
            for name in names:
                out[name] = rest.strip()
        elif stripped and names:
            for name in names:
                out[name] = f"{out[name]} {stripped}"
    return out


def _plain(text: str) -> str:
    return text.replace("``", "`")


@lru_cache(maxsize=1)
def interface_doc() -> str:
    """The compact interface a program is written against, generated from program_features.py and the operations table.

    Generated rather than hand written so the prompt can never promise a name the static check rejects.
    """
    docs = _field_docs()
    shared: dict[str, list[str]] = {}  # one line for fields documented together (key_norm, value_norm)
    for name in (*feats.TENSOR_FIELDS, *feats.SCALAR_FIELDS):
        shared.setdefault(docs.get(name, "") or name, []).append(name)
    fields = []
    for described, names in shared.items():
        kind = "tensor" if names[0] in feats.TENSOR_FIELDS else "number"
        label = ", ".join(f"f.{name}" for name in names)
        fields.append(f"- {label} ({kind}): {_plain(described)}" if described not in names else f"- {label} ({kind})")
    selection = ", ".join([*(f'"{key}": int in [{lo}, {hi}]' for key, (lo, hi) in SELECTION_RANGES.items()),
                           *(f'"{key}": one of {", ".join(map(repr, choices))}'
                             for key, choices in SELECTION_CHOICES.items())])
    shapes = ", ".join(f"{k} = {v}" for k, v in _SHAPES.items())
    lines = [
        "A program is one Python file: a docstring, an optional literal SELECTION dict, and def score(f).",
        "score(f) gets the features of one layer and returns one float score per cached entry and KV head,",
        "shape (b, h, n) (the shape of f.key_norm). Higher scores are kept; the lowest are evicted.",
        f"Shapes: {shapes}.",
        "",
        "Fields of f (tensors are float32 and read-only):",
        *fields,
        "",
        *operations.describe(),
        "",
        f"SELECTION (optional literal dict, these keys only): {{{selection}}}.",
        "chunk_size keeps or evicts whole chunks of that many entries; sink always keeps the first entries.",
        "allocation 'layer' or 'global' moves budgets between heads and needs chunk_size 1.",
        "",
        "Rules:",
        "- return finite float scores of shape (b, h, n); higher = keep",
        "- the last f.window entries are always kept by the engine; do not special-case them",
    ]
    return "\n".join(lines)


def check_edit_format(edit_format: str) -> None:
    if edit_format not in EDIT_FORMATS:
        raise ValueError(f"edit_format {edit_format!r} is not supported; use one of {list(EDIT_FORMATS)}")


def _format_score(score: float | None) -> str:
    return "not measured yet" if score is None else f"{score:.4g}"


def build_messages(parent: Program, inspirations: Sequence[Program], parent_score: float | None,
                   inspiration_scores: Sequence[float | None], edit_format: str) -> list[dict[str, str]]:
    """System and user chat messages asking for a better child of ``parent``.

    The inspirations show other scored programs so the model can combine ideas instead of only
    perturbing one; ``edit_format`` picks a whole rewritten program (``block``) or SEARCH/REPLACE
    edits of the parent (``diff``, cheaper for large models, unreliable for small ones).
    """
    check_edit_format(edit_format)
    if len(inspiration_scores) != len(inspirations):
        raise ValueError(f"got {len(inspirations)} inspirations but {len(inspiration_scores)} inspiration scores")
    system = (
        "You are an expert in transformer inference who writes small Python programs that decide which "
        "KV-cache entries to evict when a long context is compressed. The compressed cache must still let "
        "the model retrieve facts (needles, passages, code) from anywhere in the context.\n\n"
        + interface_doc()
    )
    parts = [
        "Improve this KV-cache eviction program. Its score (higher is better: the task score of "
        f"long-context retrieval with the compressed cache) is {_format_score(parent_score)}.",
        "",
        "```python",
        parent.source.rstrip("\n"),
        "```",
    ]
    for i, (program, score) in enumerate(zip(inspirations, inspiration_scores), start=1):
        parts += ["", f"Other program {i} (score {_format_score(score)}):", "```python",
                  program.source.rstrip("\n"), "```"]
    parts.append("")
    parts.append("Propose one change that should raise the score: a different combination of the signals, "
                 "smoothing, normalisation, per-layer behaviour or SELECTION values. Keep it short and "
                 "follow the rules.")
    if edit_format == "block":
        parts.append("Reply with the whole rewritten program in a single ```python fenced block "
                     "(docstring, optional SELECTION, def score(f)), then stop.")
    else:
        parts += [
            "Reply with one or more SEARCH/REPLACE blocks that edit the first program, in this format:",
            "<<<<<<< SEARCH",
            "old lines, copied exactly from the program",
            "=======",
            "new lines",
            ">>>>>>> REPLACE",
            "Each SEARCH part must match exactly one place in the program. Reply with the blocks only.",
        ]
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n".join(parts)}]


# --- reply parsing ----------------------------------------------------------------------------------

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
_PYTHON_TAGS = ("python", "py", "python3")


def _strip_reasoning(reply: str) -> str:
    """Drop ``<think>`` sections: reasoning models may sketch code there that is not the answer."""
    return _THINK.sub("", reply)


def extract_program(reply: str) -> str | None:
    """The first ```python fenced block of ``reply`` (else the first fenced block), dedented; None if none.

    An unclosed fence (a reply cut off at the token limit) is no program: its end is missing.
    """
    blocks: list[tuple[str, str]] = []
    lines = _strip_reasoning(reply).splitlines()
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if not stripped.startswith("```"):
            i += 1
            continue
        words = stripped[3:].strip().split()
        tag = words[0].lower() if words else ""
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            break
        body = textwrap.dedent("\n".join(lines[i + 1:end])).strip("\n")
        blocks.append((tag, body))
        i = end + 1
    for tag, body in blocks:
        if tag in _PYTHON_TAGS and body.strip():
            return body + "\n"
    for _, body in blocks:
        if body.strip():
            return body + "\n"
    return None


_SEARCH = re.compile(r"^<{5,9} ?SEARCH\s*$")
_DIVIDER = re.compile(r"^={5,9}\s*$")
_REPLACE = re.compile(r"^>{5,9} ?REPLACE\s*$")


def _parse_edits(reply: str) -> list[tuple[list[str], list[str]]] | None:
    edits: list[tuple[list[str], list[str]]] = []
    state, search, replace = "out", [], []
    for line in _strip_reasoning(reply).splitlines():
        stripped = line.strip()
        if state == "out":
            if _SEARCH.match(stripped):
                state, search, replace = "search", [], []
        elif state == "search":
            if _DIVIDER.match(stripped):
                state = "replace"
            elif _SEARCH.match(stripped) or _REPLACE.match(stripped):
                return None
            else:
                search.append(line)
        else:
            if _REPLACE.match(stripped):
                edits.append((search, replace))
                state = "out"
            elif _SEARCH.match(stripped) or _DIVIDER.match(stripped):
                return None
            else:
                replace.append(line)
    if state != "out" or not edits:
        return None
    return edits


def apply_search_replace(source: str, reply: str) -> str | None:
    """``source`` with every SEARCH/REPLACE block of ``reply`` applied in order; None if any fails.

    Each SEARCH part must equal exactly one run of whole lines of the current source (trailing
    whitespace ignored): an edit that matches nowhere or twice is ambiguous, and a half-applied
    reply is a program nobody asked for.
    """
    edits = _parse_edits(reply)
    if edits is None:
        return None
    lines = source.splitlines()
    for search, replace in edits:
        if not any(line.strip() for line in search):
            return None
        k = len(search)
        wanted = [line.rstrip() for line in search]
        hits = [i for i in range(len(lines) - k + 1) if [line.rstrip() for line in lines[i:i + k]] == wanted]
        if len(hits) != 1:
            return None
        lines[hits[0]:hits[0] + k] = replace
    return "\n".join(lines) + "\n"


# --- mutators ---------------------------------------------------------------------------------------

ScoreLookup = Callable[[Program], float | None]


class CountingMutator:
    """Counters shared by both back ends (read by the search loop's log)."""

    repeat_edits = 0  # a repeat is stored as a duplicate at once: asking again costs a whole call (13-45 s on CPU)
    proposed: int
    malformed: int
    unchanged: int  # children whose syntax tree equals the parent's (small models often copy)
    seconds: float
    last_reply: str | None
    score_of: ScoreLookup | None

    def _scores(self, parent: Program, inspirations: Sequence[Program]) -> tuple[float | None, list[float | None]]:
        if self.score_of is None:
            return None, [None] * len(inspirations)
        return self.score_of(parent), [self.score_of(p) for p in inspirations]

    def _child(self, parent: Program, reply: str, edit_format: str) -> Program | None:
        self.last_reply = reply
        if edit_format == "diff":
            source = apply_search_replace(parent.source, reply)
        else:
            source = extract_program(reply)
        if source is None or not source.strip():
            self.malformed += 1
            return None
        child = Program(source)
        if child.code_hash == parent.code_hash:
            self.unchanged += 1
        return child
