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
    deltas = [text.push(ids[: i + 1]) for i in range(len(ids))]
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
