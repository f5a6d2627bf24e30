"""Streaming text: deltas that reassemble to the whole answer, stop strings cut and never leaked half-way."""

from __future__ import annotations

from conftest import CharTokenizer

from kvsieve.serve.text_stream import IncrementalText, cut_at_stop


class ByteTokenizer:
    """UTF-8 bytes as ids: a multi-byte character decodes to U+FFFD until its last byte arrives."""

    def decode(self, ids, **_):
        return bytes(ids).decode("utf-8", errors="replace")


def stream(tokenizer, ids, stops=()):
    text = IncrementalText(tokenizer, stops)
    deltas = [text.add(token) for token in ids]
    final, _ = cut_at_stop(tokenizer.decode(ids), stops)
    return deltas, deltas and "".join(deltas) + text.finish(final), final


def test_cut_at_stop_takes_the_earliest_stop_and_excludes_it():
    assert cut_at_stop("abc STOP def END", ("END", "STOP")) == ("abc ", True)
    assert cut_at_stop("no stop here", ("END",)) == ("no stop here", False)
    assert cut_at_stop("", ()) == ("", False)


def test_deltas_reassemble_to_the_answer_without_stops():
    ids = [ord(c) for c in "The magic number is 2507438."]
    deltas, joined, final = stream(CharTokenizer(), ids)
    assert joined == final == "The magic number is 2507438."
    assert deltas[0] == "T" and all(len(d) == 1 for d in deltas)  # nothing held back without stop strings


def test_a_stop_string_is_held_back_until_it_cannot_start_and_never_sent():
    ids = [ord(c) for c in "answer: 42\nEND more text"]
    deltas, joined, final = stream(CharTokenizer(), ids, stops=("\nEND",))
    assert final == "answer: 42" and joined == final
    sent = ""
    for delta in deltas:
        sent += delta
        assert "\nE" not in sent  # a prefix of the stop string never reaches the client
    # held back by len(stop) - 1 characters while it could still become the stop string
    assert "".join(deltas[: len("answer: 42")]) == "answer:"


def test_a_multibyte_character_is_sent_whole():
    ids = list("π = 3.14".encode())
    deltas, joined, final = stream(ByteTokenizer(), ids)
    assert joined == final == "π = 3.14"
    assert "\ufffd" not in "".join(deltas) and deltas[0] == "" and deltas[1] == "π"


class CountingTokenizer(CharTokenizer):
    """Counts the token ids decoded: the whole answer per step was quadratic in its length."""

    def __init__(self) -> None:
        self.decoded = 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return super().decode(ids, **kwargs)


def test_each_token_is_decoded_in_a_short_window_not_the_whole_answer():
    tokenizer = CountingTokenizer()
    ids = [ord(c) for c in "x" * 400]
    deltas, joined, final = stream(tokenizer, ids, stops=("END",))
    assert joined == final
    assert tokenizer.decoded - len(ids) <= 4 * len(ids)  # a window of a token or two per step (was ~n^2 / 2 = 80k)


def test_a_real_tokenizer_streams_to_its_own_full_decode(smollm2):
    _, tokenizer = smollm2
    text = "Résumé: the café's naïve π-day plan costs 3.14 €, see https://example.com/a_b?c=d. 数字 42!\n  Done."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stream_text = IncrementalText(tokenizer)
    deltas = [stream_text.add(token) for token in ids]
    final = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) + stream_text.finish(final) == final
    assert stream_text.text == final
