"""Requests -> the engine's ``Prompt``: context ids (compressed) and question ids (the last user turn).

The last user turn plays the role of the question, as in calibration. A conversation of one user message
is split the way ``kvsieve.engine.generate.build_prompt`` splits ``context + "\\n" + question``: after the
message's last newline, so a RULER-style prompt sent as one message is cut exactly where it was cut when the
contract was certified. A completion prompt is split after its last newline too (without one, its last token
is the question).
"""

from __future__ import annotations

import secrets

import torch

from kvsieve.prompt import Prompt
from kvsieve.serve.errors import APIError
from kvsieve.serve.schemas import ChatMessage

__all__ = ["chat_prompt", "completion_prompt"]



def _marker(texts: list[str]) -> str:
    """Where the question starts, found again after the template ran: fresh per request and absent from every
    message, so no client text can pose as it (a fixed marker sent in a message split the prompt wrongly)."""
    while True:
        mark = f"\x00kvsieve-question-{secrets.token_hex(8)}\x00"
        if not any(mark in t for t in texts):
            return mark


def _ids(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]], dtype=torch.long)


def _question_start(messages: list[ChatMessage], last: int) -> int:
    """Character offset, inside the last user turn, where the question starts."""
    text = messages[last].text
    only_turn = all(m.role in ("system", "developer") for i, m in enumerate(messages) if i != last)
    if only_turn and "\n" in text.rstrip("\n"):
        return text.rstrip("\n").rindex("\n") + 1  # build_prompt's layout: the newline stays with the context
    return 0


def chat_prompt(tokenizer, messages: list[ChatMessage]) -> Prompt:
    if not messages:
        raise APIError(400, "messages is empty: give at least one user message", "messages")
    users = [i for i, m in enumerate(messages) if m.role == "user"]
    if not users:
        raise APIError(400, "messages has no user turn; its last user turn is the question", "messages")
    last = users[-1]
    start = _question_start(messages, last)
    rows = [{"role": m.role, "content": m.text} for m in messages]
    text = messages[last].text
    mark = _marker([r["content"] for r in rows])
    rows[last] = {"role": "user", "content": text[:start] + mark + text[start:]}
    if getattr(tokenizer, "chat_template", None):
        full = tokenizer.apply_chat_template(rows, tokenize=False, add_generation_prompt=True)
    else:
        full = "\n".join(r["content"] for r in rows) + "\n"
    if full.count(mark) != 1:
        raise APIError(500, "the chat template dropped or repeated the question marker; cannot split the prompt")
    split = full.index(mark)
    context_text, question_text = full[:split], full[split + len(mark):]
    context, question = _ids(tokenizer, context_text), _ids(tokenizer, question_text)
    if context.shape[1] == 0 or question.shape[1] == 0:
        raise APIError(400, "the prompt has no context before the last user turn, or an empty question", "messages")
    return Prompt(context, question, context_text, 0)


def completion_prompt(tokenizer, text: str) -> Prompt:
    if not text:
        raise APIError(400, "prompt is empty", "prompt")
    body = text.rstrip("\n")
    if "\n" in body:
        split = body.rindex("\n") + 1
        context, question = _ids(tokenizer, text[:split]), _ids(tokenizer, text[split:])
    else:
        ids = _ids(tokenizer, text)
        context, question = ids[:, :-1], ids[:, -1:]
    if context.shape[1] == 0:
        raise APIError(400, f"prompt {text[:40]!r} is a single token: nothing to keep in a cache", "prompt")
    return Prompt(context, question, text, 0)
