"""How an lm-eval prompt is cut into what kvsieve compresses, what is asked after it, and the answer's opening words.

lm-eval hands its backend (``lm_eval_backend.py``) one string per request, without a chat template; the backend
applies the model's template itself (as kvsieve's harness does) after splitting the string into context, question
and answer prefix:

1. *answer prefix*: the document's ``gen_prefix`` field (RULER's "The special magic number for X ... is"),
   when the prompt ends with it; lm-eval put it there, and it is cut off and decoded after the template's
   assistant header (kvsieve's ``answer_prefix``);
2. *question*: the rest's last line (after its last newline), when that line is non-empty and shorter than
   the text before it: RULER's ``input`` ends with the question on its own line;
3. *context*: everything before that newline.

Where rule 2 holds, the cell is **query-agnostic** (the context is compressed before the question is
read; the row's ``question_aware`` is false). Where it does not (no newline, an empty or long last line),
the whole text is the context, read with the question inside the observation window: the cell is
**question-aware** and the row says so (``question_aware`` true, shown as ``POLICY+qa``;
``config.lm_eval.split`` names the rule's outcome). ``qa=always`` makes every cell question-aware.
``--apply_chat_template`` is refused: a templated string can no longer be split.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Split", "split_prompt"]


@dataclass(frozen=True)
class Split:
    """A prompt cut into what is compressed, what is asked after, and the answer's opening words."""

    context: str
    question: str
    answer_prefix: str
    question_aware: bool
    rule: str  # "last line" (query-agnostic), or why the cell is question-aware


def split_prompt(prompt: str, gen_prefix: str | None = None, qa: str = "auto") -> Split:
    """The documented rule (module docstring): ``gen_prefix`` cut off the end, the last line the question."""
    if qa not in ("auto", "always"):
        raise ValueError(f"qa must be 'auto' or 'always', got {qa!r}")
    text, prefix = prompt, ""
    if gen_prefix and prompt.rstrip().endswith(gen_prefix.strip()):
        text = prompt.rstrip()[: -len(gen_prefix.strip())]
        prefix = gen_prefix.strip()
    text = text.rstrip()
    head, newline, last = text.rpartition("\n")
    last = last.strip()
    if not newline or not head.strip():
        reason = "no line break: question-aware"
    elif not last:
        reason = "empty last line: question-aware"
    elif len(last) >= len(head):  # the bulk of the prompt is on its last line: no context to compress before it
        reason = "last line longer than the text before it: question-aware"
    else:
        reason = ""
    if reason or qa == "always":
        if newline and head.strip() and last:  # keep the layout; the question is read before compressing
            return Split(head, last, prefix, True, reason or "qa=always")
        return Split(text, "", prefix, True, reason)
    return Split(head, last, prefix, False, "last line")
