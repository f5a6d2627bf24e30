"""kvsieve serve's steps: chunked prefill that compresses as if the prompt were read at once, a running stream that
gets a token every step whatever arrives, and a KV-byte budget no request can pass (tiny random llama, char
tokenizer; see test_serve.py)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import pytest
import torch
from conftest import random_kvzap, tiny_model
from test_serve import BYTES_PER_TOKEN, NAME, ChatTokenizer, _wait, client, hook, make_state, running

from kvsieve.engine.attach import attach
from kvsieve.engine.cache import cache_allocated_bytes, sieve_layers
from kvsieve.engine.generate import generate
from kvsieve.engine.reader import first_part
from kvsieve.policies import get, parse
from kvsieve.policies.label import Point
from kvsieve.policies.operating_point import OperatingPoint
from kvsieve.prompt import build_prompt
from kvsieve.serve.command import point_source
from kvsieve.serve.generation import Prefill
from kvsieve.serve.points import ChosenPoint


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


def _doc(i: int, length: int) -> str:
    return "".join(chr(97 + (j * (i + 3) + i) % 26) for j in range(length))


def _engine_cache(model, prompt, policy, ratio: float, question_aware: bool):
    """The engine's own prefill (the whole first part in one forward, compressed at its end), then the question."""
    tail = prompt.question_ids.shape[1] if question_aware else 0
    with attach(model, policy, ratio=ratio, protected_tail=tail):
        out = model(input_ids=first_part(prompt, question_aware), use_cache=True, logits_to_keep=1)
        if not question_aware:
            out = model(input_ids=prompt.question_ids, cache=out.cache, use_cache=True, logits_to_keep=1)
    return out.cache, out.logits[0, -1]


SPECS = [("knorm", False), ("snapkv", False), ("h2o", False), ("expected_attention", False), ("tova", True),
         ("adakv", False), ("kvzap", False), ("kvzip", False), ("full", False)]


@pytest.mark.parametrize(("spec", "question_aware"), SPECS)
def test_a_prompt_read_in_chunks_is_compressed_as_if_read_at_once(model, tmp_path, spec, question_aware):
    """Keys (knorm), window queries (snapkv, tova), accumulated attention (h2o), query statistics (expected attention),
    per-head budgets (adakv), global allocation over a surrogate's scores (kvzap), a reconstruction (kvzip): each
    policy keeps the same entries of a prompt read in chunks of 17 and 64 tokens as of the prompt read in one
    forward."""
    if spec == "kvzap":
        spec = f"kvzap(checkpoint='{random_kvzap(model, tmp_path / 'z.safetensors', name=NAME)}', allocation='global')"
    parsed = parse(spec)
    policy = get("kvzip", tokenizer=ChatTokenizer()) if spec == "kvzip" else parsed.build()
    policy.check_model(model, NAME)
    ratio = 0.0 if spec == "full" else 0.5
    point = OperatingPoint.full() if spec == "full" else OperatingPoint(Point(parsed, ratio, question_aware), policy)
    prompt = build_prompt(ChatTokenizer(), _doc(1, 230), "which letter?")
    n, m, max_tokens = prompt.context_ids.shape[1], prompt.question_ids.shape[1], 5
    want, want_logits = _engine_cache(model, prompt, policy, ratio, question_aware)
    for chunk in (17, 64):
        prefill = Prefill(model, prompt, ChosenPoint(point, "uncertified"), max_tokens)
        reads = []
        while not prefill.done:
            reads.append(prefill.advance(chunk))
        cache, logits, info = prefill.finished()
        assert max(reads) <= chunk and sum(reads) == n + m and info.chosen.status == "uncertified"
        for (_, got), (_, ref) in zip(sieve_layers(cache), sieve_layers(want), strict=True):
            assert torch.equal(got.positions, ref.positions) and got.head_lengths == ref.head_lengths
            torch.testing.assert_close(got.keys, ref.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
        # room for exactly max_tokens more entries in every segment (rounded up within a store's buckets): at most
        # what the request is admitted for, b x (prompt + max_tokens)
        room = [int((layer.store.capacity - layer.store.lengths).min()) for _, layer in sieve_layers(cache)]
        assert room == [max_tokens] * len(room)
        assert cache_allocated_bytes(cache) <= BYTES_PER_TOKEN * (n + m + max_tokens)


def _forwards(log: list):
    """A forward pre-hook noting each forward: ("decode", rows) for a decode step (it passes position_ids), else
    ("prefill", tokens)."""

    def note(_m, _a, kwargs):
        ids = kwargs["input_ids"]
        if kwargs.get("position_ids") is not None:
            log.append(("decode", ids.shape[0]))
        else:
            log.append(("prefill", ids.shape[1]))
        time.sleep(0.002)

    return note


def test_a_running_stream_gets_a_token_every_step_whatever_arrives(model):
    """The landed scheduler prefilled every waiting request that fit before its next decode step: with a stream
    running, four 240-token prompts arriving read 960 prompt tokens between two of its tokens. Now a step is at
    most one chunk of prefill (32 tokens here) and one decode step."""
    state = make_state(model, max_queue=16, prefill_chunk=32)
    log: list = []
    with hook(model, _forwards(log)), running(state) as url:
        body = {"model": NAME, "max_tokens": 120, "stream": True,
                "messages": [{"role": "user", "content": _doc(0, 60) + "\nq"}]}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as reply:
            lines = reply.iter_lines()
            assert next(lines).startswith("data: ")  # the stream is decoding
            c = client(url)

            def ask(i: int):
                return c.chat.completions.create(model=NAME, max_tokens=4, messages=[
                    {"role": "user", "content": _doc(i, 240) + "\nnext?"}])

            with ThreadPoolExecutor(4) as pool:
                replies = list(pool.map(ask, range(1, 5)))
            rest = [line for line in lines if line]
        metrics = httpx.get(url + "/metrics").text
    assert all(r.usage.completion_tokens == 4 for r in replies) and rest[-1] == "data: [DONE]"
    decodes = [i for i, (kind, _) in enumerate(log) if kind == "decode"]
    between = [sum(t for kind, t in log[a + 1:b] if kind == "prefill") for a, b in zip(decodes, decodes[1:])]
    assert sum(between) >= 4 * 240  # the four prompts were read while the stream decoded
    assert max(between) <= 32, max(between)
    # every generated token but a request's first has a gap; every request a time to first token
    tokens = 120 + 4 * 4
    assert f"kvsieve_inter_token_seconds_count {tokens - 5}\n" in metrics
    assert "kvsieve_time_to_first_token_seconds_count 5\n" in metrics


def test_max_tokens_below_the_growth_step_never_passes_the_budget(model):
    """A full-KV request with max_tokens=4 under a budget of exactly its need (prompt + 4 tokens): the store's
    growth rule (room for at least 64 entries) made its cache allocate 60 tokens more than it was admitted for,
    and the landed scheduler charged that unchecked."""
    state = make_state(model, point_source(NAME), kv_budget=1)  # the budget is set below, once the need is known
    doc = _doc(2, 170)
    prompt = build_prompt(ChatTokenizer(), doc, "next?")
    tokens = prompt.context_ids.shape[1] + prompt.question_ids.shape[1]
    budget = BYTES_PER_TOKEN * (tokens + 4)
    state.scheduler.budget = budget
    seen = []

    def watch(_m, _a, kwargs):
        seen.append(state.scheduler.charged)

    with hook(model, watch), running(state) as url:
        c = client(url)

        def ask(_i: int):
            return c.chat.completions.create(model=NAME, max_tokens=4,
                                             messages=[{"role": "user", "content": doc + "\nnext?"}])

        with ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(ask, range(3)))
    want = generate(model, ChatTokenizer(), doc, "next?", max_new_tokens=4)
    assert [r.choices[0].message.content for r in replies] == [want.text] * 3
    assert max(seen) == budget and state.scheduler.peak_charged == budget  # one at a time, each exactly its need
    assert state.scheduler.charged == 0


def test_a_request_charged_after_its_prefill_holds_exactly_its_entries_and_room(model):
    """Compressed, ragged (adakv): its charge once prefilled is what its cache allocates, at most its admission."""
    state = make_state(model, point_source(NAME, policy="adakv", ratio=0.5), prefill_chunk=40)
    gate, charges = threading.Event(), []

    def hold(_m, _a, kwargs):
        if kwargs.get("position_ids") is not None and not gate.is_set():
            charges.append(state.scheduler.charged)
            gate.set()

    doc = _doc(3, 200)
    with hook(model, hold), running(state) as url:
        reply = client(url).chat.completions.create(model=NAME, max_tokens=6,
                                                    messages=[{"role": "user", "content": doc + "\nnext?"}])
        _wait(lambda: state.scheduler.charged == 0)
    prompt = build_prompt(ChatTokenizer(), doc, "next?")
    tokens = prompt.context_ids.shape[1] + prompt.question_ids.shape[1]
    kept = reply.usage.kv_cache["bytes_kept"]
    assert kept < BYTES_PER_TOKEN * tokens // 2 + BYTES_PER_TOKEN * 3  # about half the context was dropped
    # its entries, its question and 6 tokens of room in every (layer, head) segment, rounded up within buckets
    floor = kept + BYTES_PER_TOKEN * (prompt.question_ids.shape[1] + 6)
    assert floor <= charges[0] <= BYTES_PER_TOKEN * (tokens + 6)
