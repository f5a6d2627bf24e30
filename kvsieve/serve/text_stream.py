"""Detokenize a growing token list into text deltas, holding back what could still become a stop string."""

from __future__ import annotations

__all__ = ["IncrementalText", "cut_at_stop"]


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """``text`` up to the earliest stop string (excluded, as OpenAI does) and whether one was found."""
    hits = [text.index(s) for s in stops if s in text]
    return (text[: min(hits)], True) if hits else (text, False)


class IncrementalText:
    """``push(tokens)`` returns the new visible text; ``finish(final)`` the rest. The deltas concatenate to the
    final text (decoded from all tokens at once), so a stream reassembles to the non-streamed answer."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = ""

    def _delta(self, visible: str) -> str:
        if not visible.startswith(self.sent):  # an earlier piece decoded differently in context: wait for the end
            return ""
        delta, self.sent = visible[len(self.sent):], visible
        return delta

    def push(self, tokens: list[int]) -> str:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a multi-byte character not complete yet
            return ""
        text, stopped = cut_at_stop(text, self.stops)
        if not stopped and self.hold:
            text = text[: max(0, len(text) - self.hold)]
        return self._delta(text)

    def finish(self, final: str) -> str:
        return final[len(self.sent):] if final.startswith(self.sent) else ""
