"""An in-process LLM mutator whose every proposal is a program the checker accepts: decoding under the grammar.

The bundled coder, asked for a program freely, wrote calls outside the interface two times in three (issue 50).
Here each next token is masked to those the language's typed grammar allows (``grammar.decoding_lark``: one
typed return expression in a ```python block), so the reply is a program stage 0 accepts whatever the model
prefers; the model still chooses among the allowed tokens, prompted with the parents, their scores and the
interface. The mask comes from llguidance (a small Rust library with no Python dependencies that reads Lark
grammars directly; xgrammar, the alternative, pulls in triton, about 1 GB, on a CPU-only machine).

A reply cut off at ``max_new_tokens`` is no program (counted in ``malformed``), never a truncated one.
"""

from __future__ import annotations

from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from kvsieve.evolve.mutators.local_model import LocalLLMMutator
from kvsieve.language import grammar

__all__ = ["ConstrainedLLMMutator"]


class _GrammarMask:
    """A logits processor: the tokens the grammar does not allow next get -inf (batch of one)."""

    def __init__(self, matcher: Any, vocab_size: int, prompt_length: int) -> None:
        self.matcher, self.prompt_length = matcher, prompt_length
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.prompt_length:  # the token chosen last step
            if not self.matcher.consume_token(int(input_ids[0, -1])):
                raise RuntimeError(f"the grammar refused a token it allowed: {self.matcher.get_error()}")
        llguidance.torch.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        masked = scores.float().cpu()
        width = min(masked.shape[-1], self.bitmask.shape[-1] * 32)
        llguidance.torch.apply_token_bitmask_inplace(masked[:, :width], self.bitmask)
        masked[:, width:] = float("-inf")  # padding rows of the output layer beyond the tokenizer
        return masked.to(scores.device, scores.dtype)


class ConstrainedLLMMutator(LocalLLMMutator):
    """:class:`LocalLLMMutator` decoding under the language's typed grammar (see the module docstring)."""

    name = "constrained"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._grammar = llguidance.LLMatcher.grammar_from_lark(grammar.decoding_lark(fenced=True))
        self._lltokenizer = None

    def __repr__(self) -> str:
        return super().__repr__().replace("LocalLLMMutator", "ConstrainedLLMMutator")

    def _constraints(self, tokenizer: Any, prompt_length: int) -> list:
        if self._lltokenizer is None:
            self._lltokenizer = llguidance.hf.from_tokenizer(tokenizer)
        matcher = llguidance.LLMatcher(self._lltokenizer, self._grammar)
        if matcher.is_error():
            raise ValueError(f"the policy grammar does not compile for this tokenizer: {matcher.get_error()}")
        return [_GrammarMask(matcher, self._lltokenizer.vocab_size, prompt_length)]
