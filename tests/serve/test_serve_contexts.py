"""The context cache (``serve/contexts.py``): a document read once, kept compressed (hot and cold tiers), and every
later question about it read on a copy, through the real HTTP API with the official ``openai`` client.

Each answer is checked against ``generate``, which reads the document again from scratch for every question (the
independent derivation: nothing is reused there); the counts against the questions sent."""

from __future__ import annotations

import httpx2 as httpx
import pytest
import torch
from conftest import tiny_model
from test_serve import BYTES_PER_TOKEN, DOC, NAME, ChatTokenizer, client, make_state, running

from kvsieve.engine.cache import sieve_layers
from kvsieve.engine.generate import generate
from kvsieve.engine.reader import Capture, read_prompt
from kvsieve.policies import get
from kvsieve.recall import Recall
from kvsieve.serve.command import build_state, point_source
from kvsieve.serve.contexts import ContextCache, StoredContext, scope_of

RECALL = "recall(fraction=0.1, chunk=8, pool='span')"
QUESTIONS = ["which letter?", "what comes after b?", "is there a z?"]
OTHER = "".join(chr(97 + (i * 11) % 26) for i in range(150))


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


def _ask(url: str, doc: str, question: str, key: str = "unused"):
    c = client(url).with_options(api_key=key)
    return c.chat.completions.with_raw_response.create(
        model=NAME, messages=[{"role": "user", "content": doc + "\n" + question}], max_tokens=8)


def _counts(url: str) -> dict[str, float]:
    lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    return {line.split()[0]: float(line.split()[1]) for line in lines
            if line.startswith("kvsieve_context_cache") and not line.startswith("#")}


def _stored(model, ids: list[int], scope: str = "", point: str = "knorm@0.5") -> StoredContext:
    tensor = torch.tensor([ids])
    read = read_prompt(model, tensor, Capture())
    return StoredContext(scope, point, tensor, [len(ids)] * 3, BYTES_PER_TOKEN * len(ids), hot=read.cache)


def test_the_longest_stored_prefix_matches_only_in_its_scope_and_at_its_point(model):
    contexts = ContextCache(cold_budget=0)
    short, long = _stored(model, [5, 6, 7]), _stored(model, [5, 6, 7, 8, 9])
    others = _stored(model, [5, 6, 7, 8, 9], scope="key:x"), _stored(model, [5, 6], point="tova@0.5")
    for entry in (short, long, *others):
        assert contexts.put(entry, hot_room=1 << 30)
    assert contexts.match("", "knorm@0.5", torch.tensor([[5, 6, 7, 8, 9, 10]])) is long
    assert contexts.match("", "knorm@0.5", torch.tensor([[5, 6, 7, 8, 4]])) is short
    assert contexts.match("", "knorm@0.5", torch.tensor([[5, 6, 4]])) is None  # only the other point's holds 5 6
    assert contexts.match("key:y", "knorm@0.5", torch.tensor([[5, 6, 7, 8, 9]])) is None
    assert contexts.match("", "knorm@0.5", torch.tensor([[5, 6]])) is None  # a stored context longer than the prompt


def test_the_least_recently_used_context_goes_first_and_one_too_large_is_refused(model):
    contexts = ContextCache(cold_budget=0)
    a, b, c = (_stored(model, [i, i + 1, i + 2]) for i in (1, 10, 20))
    room = a.hot_bytes + b.hot_bytes
    assert contexts.put(a, room) and contexts.put(b, room)
    contexts.used(contexts.match("", "knorm@0.5", a.ids))  # a used after b: b is now the least recently used
    assert contexts.put(c, room)
    assert contexts.match("", "knorm@0.5", b.ids) is None and contexts.match("", "knorm@0.5", a.ids) is a
    assert contexts.hot_bytes == a.hot_bytes + c.hot_bytes
    assert not contexts.put(_stored(model, list(range(30, 40))), room)  # larger than all the room: nothing evicted
    assert len(contexts) == 2
    assert scope_of("api-key", "Bearer k1") == scope_of("api-key", "k1") != scope_of("api-key", "Bearer k2")
    assert scope_of("shared", "Bearer k1") == ""
    with pytest.raises(ValueError, match="context scope 'team' is not one of shared, api-key"):
        scope_of("team", None)


def test_questions_about_one_document_read_it_once_and_answer_as_a_fresh_read_does(model):
    points = point_source(NAME, policy="knorm", ratio=0.75, recall=RECALL, evict_every=0)
    state = make_state(model, points, cold_budget=1 << 20)
    with running(state) as url:
        first = _ask(url, DOC, QUESTIONS[0])
        entry = next(iter(state.scheduler.contexts._entries.values()))
        before = [layer.keys.clone() for _, layer in sieve_layers(entry.tiers.hot)]
        replies = [first] + [_ask(url, DOC, q) for q in QUESTIONS[1:]]
        counts = _counts(url)
    after = [layer.keys for _, layer in sieve_layers(entry.tiers.hot)]
    assert all(torch.equal(x, y) for x, y in zip(before, after))  # the questions left the stored context as it was
    for question, raw in zip(QUESTIONS, replies):
        reply = raw.parse()
        alone = generate(model, ChatTokenizer(), DOC, question, get("knorm"), ratio=0.75, max_new_tokens=8,
                         recall=Recall.parse(RECALL))
        assert reply.choices[0].message.content == alone.text
        assert reply.usage.kv_cache["bytes_moved"] == alone.moved_bytes > 0
    assert [r.headers["x-kvsieve-context-cache"] for r in replies] == ["miss", "hit", "hit"]
    assert counts["kvsieve_context_cache_hits_total"] == 2 and counts["kvsieve_context_cache_misses_total"] == 1
    assert counts["kvsieve_context_cache_cold_bytes"] == entry.cold_bytes > 0
    assert counts["kvsieve_context_cache_hot_bytes"] == entry.hot_bytes > 0
    assert state.scheduler.peak_charged <= state.scheduler.budget


def test_a_full_kv_server_reuses_the_whole_context_and_answers_the_same(model):
    state = make_state(model, point_source(NAME), cold_budget=0)
    with running(state) as url:
        replies = [_ask(url, DOC, q).parse() for q in QUESTIONS]
        entry = next(iter(state.scheduler.contexts._entries.values()))
    for question, reply in zip(QUESTIONS, replies):
        assert reply.choices[0].message.content == generate(model, ChatTokenizer(), DOC, question, None,
                                                            max_new_tokens=8).text
    assert [r.usage.kv_cache["context_cache"] for r in replies] == ["miss", "hit", "hit"]
    assert [layer.physical_length for _, layer in sieve_layers(entry.hot)] == [entry.length] * 3  # nothing appended


def test_with_api_key_scope_a_client_never_reuses_another_clients_document(model):
    points = point_source(NAME, policy="knorm", ratio=0.75)
    state = make_state(model, points, cold_budget=0, context_scope="api-key")
    with running(state) as url:
        seen = [_ask(url, DOC, QUESTIONS[0], key).headers["x-kvsieve-context-cache"] for key in ("a", "b", "a")]
    assert seen == ["miss", "miss", "hit"]


@pytest.mark.parametrize("room, expected", [(0, ["miss", "miss", "miss"]), (2, ["miss", "miss", "hit"])])
def test_stored_contexts_count_in_the_kv_budget_and_the_oldest_goes_to_admit_a_request(model, room, expected):
    """The budget holds one request's prompt at full KV (174 tokens + max_tokens) and ``room`` more compressed
    contexts (39 entries each at 0.75): with no room, each document's request evicts the other's context."""
    need = BYTES_PER_TOKEN * (174 + 8)
    points = point_source(NAME, policy="knorm", ratio=0.75)
    state = make_state(model, points, kv_budget=need + room * BYTES_PER_TOKEN * 39, cold_budget=0)
    with running(state) as url:
        seen = [_ask(url, doc, QUESTIONS[0]).headers["x-kvsieve-context-cache"] for doc in (DOC, OTHER, DOC)]
        counts = _counts(url)
    assert seen == expected
    assert counts.get("kvsieve_context_cache_evictions_total", 0) == (2 if room == 0 else 0)
    assert state.scheduler.peak_charged <= state.scheduler.budget


def test_without_a_context_cache_nothing_is_kept(model):
    state = make_state(model, point_source(NAME, policy="knorm", ratio=0.75))
    with running(state) as url:
        kv = [_ask(url, DOC, QUESTIONS[0]).parse().usage.kv_cache for _ in range(2)]
    assert [k["context_cache"] for k in kv] == [None, None] and state.scheduler.contexts is None


@pytest.mark.model
def test_smollm2_answers_two_questions_about_one_document_from_its_compressed_context(smollm2):
    """The bundled SmolLM2 through the HTTP API: the document is read once, the second question recalls from its cold
    tier, and both answers are ``generate``'s with the same recall (which reads the document again each time)."""
    model, tokenizer = smollm2
    recall = "recall(fraction=0.1, chunk=16, pool='span')"
    state = build_state(model, tokenizer, "smollm2-135m-instruct",
                        point_source("smollm2-135m", policy="knorm", ratio=0.75, recall=recall), max_tokens_limit=24,
                        kv_budget="256MiB", cold_budget="64MiB")
    document = ("Notes from the archive. " * 10 + "The special magic number for the blue door is 7423. "
                + "The records continue without change. " * 10 + "The special magic number for the red gate is 5190. "
                + "Nothing else happened that day. " * 10)
    questions = ["What is the special magic number for the blue door?",
                 "What is the special magic number for the red gate?"]
    with running(state) as url:
        replies = [client(url).with_options(timeout=600).chat.completions.with_raw_response.create(
            model="smollm2-135m", max_tokens=24, messages=[{"role": "user", "content": document + "\n" + q}])
            for q in questions]
    assert [r.headers["x-kvsieve-context-cache"] for r in replies] == ["miss", "hit"]
    for question, raw in zip(questions, replies):
        want = generate(model, tokenizer, document, question, get("knorm"), ratio=0.75, max_new_tokens=24,
                        recall=Recall.parse(recall))
        reply = raw.parse()
        assert reply.choices[0].message.content == want.text
        assert reply.usage.kv_cache["bytes_moved"] == want.moved_bytes > 0


def test_the_cold_budget_is_read_as_a_budget_named_for_its_flag_and_may_be_zero(capsys, monkeypatch):
    from kvsieve.serve import command

    assert command.parse_budget("0B", None, "--cold-budget", 0) == 0
    assert command.parse_budget("2GiB", None, "--cold-budget", 0) == 2 << 30
    with pytest.raises(ValueError, match=r"--kv-budget '0B' is 0 bytes: give at least 1"):
        command.parse_budget("0B")
    monkeypatch.setattr(command, "load", lambda *_a: pytest.fail("the model was loaded"))
    assert command.main(["--cold-budget", "64"]) == 2
    assert "--cold-budget '64' has no unit" in capsys.readouterr().err
    assert command.main(["--no-context-cache", "--cold-budget", "64", "--kv-budget", "lots"]) == 2  # not read then
    assert "--cold-budget" not in capsys.readouterr().err
