"""Detokenize a growing token list into text deltas, holding back what could still become a stop string."""

from __future__ import annotations

__all__ = ["IncrementalText", "cut_at_stop"]


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """``text`` up to the earliest stop string (excluded, as OpenAI does) and whether one was found."""
    hits = [text.index(s) for s in stops if s in text]
    return (text[: min(hits)], True) if hits else (text, False)


class IncrementalText:
    """``add(token)`` returns the new visible text; ``finish(final)`` the rest. The deltas concatenate to the final
    text (decoded from all tokens at once), so a stream reassembles to the non-streamed answer.

    Each token is decoded once, in a short window: the tokens since the last complete character, after the piece
    before them as context (vLLM's detokenizer keeps the same two offsets), so a step costs the window, not the
    answer so far. A piece that ends in an incomplete multi-byte character waits for the next token."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""  # every complete character decoded so far, stop strings included
        self.sent = ""
        self._context = self._done = 0  # tokens[_context:_done]: the piece the next window is decoded after

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def add(self, token: int) -> str:
        """Append one generated token; the text that became visible (nothing held back may start a stop string)."""
        self.tokens.append(token)
        before = self._decode(self.tokens[self._context:self._done])
        after = self._decode(self.tokens[self._context:])
        if len(after) > len(before) and after.startswith(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._context, self._done = self._done, len(self.tokens)
        return self._delta()

    @property
    def stopped(self) -> bool:
        """Whether the text holds one of the stop strings."""
        return any(s in self.text for s in self.stops)

    def _delta(self) -> str:
        visible, stopped = cut_at_stop(self.text, self.stops)
        if not stopped and self.hold:
            visible = visible[: max(0, len(visible) - self.hold)]
        if not visible.startswith(self.sent):  # an earlier piece decoded differently in context: wait for the end
            return ""
        delta, self.sent = visible[len(self.sent):], visible
        return delta

    def finish(self, final: str) -> str:
        return final[len(self.sent):] if final.startswith(self.sent) else ""
