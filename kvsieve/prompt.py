"""The prompt layout: a request's chat-templated token ids, split where the context ends.

Every path that prefills a request (the harness, ``generate``, the server, evolution's dev set,
training) lays it out here, so "the context part" means the same tokens everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Prompt", "build_prompt"]


@dataclass
class Prompt:
    """Token ids of a request, split so the question can be kept out of compression."""

    context_ids: torch.Tensor  # (1, n): chat-template header + context
    question_ids: torch.Tensor  # (1, m): question + template tail + answer prefix
    context_text: str = ""  # the text behind context_ids
    context_offset: int = 0  # where the raw context starts inside context_text

    def token_positions(self, tokenizer, spans: list[tuple[int, int]]) -> list[int]:
        """Positions in ``context_ids`` of the tokens overlapping character ``spans`` of the raw context."""
        encoded = tokenizer(self.context_text, add_special_tokens=False, return_offsets_mapping=True)
        shifted = [(a + self.context_offset, b + self.context_offset) for a, b in spans]
        return [i for i, (a, b) in enumerate(encoded["offset_mapping"]) if any(a < e and b > s for s, e in shifted)]

    def header_length(self, tokenizer) -> int:
        """Tokens of the chat template and instruction before the raw context starts."""
        encoded = tokenizer(self.context_text, add_special_tokens=False, return_offsets_mapping=True)
        return sum(1 for a, _ in encoded["offset_mapping"] if a < self.context_offset)


def build_prompt(tokenizer, context: str, question: str, answer_prefix: str = "",
                 separator_in_context: bool = True) -> Prompt:
    """Apply the chat template to ``context + "\n" + question`` and split it where the context ends.

    As in RULER's templates, a newline separates the context from the question, and it belongs to
    the context part: the last context tokens (the observation window of SnapKV, TOVA's last query)
    are then the end of a line, not the middle of the haystack. ``separator_in_context=False`` puts
    the newline on the question's side instead (kvsieve's earlier layout, kept for comparison).
    """
    if not context:
        raise ValueError("the context is empty")
    separator = "\n"
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": context + separator + question}]
        full = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        full = context + separator + question + "\n"
    split = full.index(context) + len(context) + (len(separator) if separator_in_context else 0)
    context_text, question_text = full[:split], full[split:] + answer_prefix

    def ids(text: str) -> torch.Tensor:
        return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]], dtype=torch.long)

    offset = full.index(context)
    return Prompt(ids(context_text), ids(question_text), context_text, offset)
