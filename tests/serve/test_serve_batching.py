"""kvsieve serve's continuous batching by KV bytes: concurrent clients decode in one batch, each at its own
point, admitted against a byte budget (tiny random llama, char tokenizer; see test_serve.py)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import pytest
from conftest import tiny_model
from test_serve import BYTES_PER_TOKEN, NAME, ChatTokenizer, _wait, client, hook, make_state, running

from kvsieve.engine.generate import generate
from kvsieve.policies import get


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


def _doc(i: int, length: int) -> str:
    """A document of its own for client ``i``: a different letter walk per client."""
    return "".join(chr(97 + (j * (i + 3) + i) % 26) for j in range(length))


# (document length, kvsieve options, the point the length contract gives it)
CASES = [(150 + 7 * i, {}, ("knorm", 0.5, False)) for i in range(8)]  # certified bucket <=256
CASES += [(40 + i, {}, ("full", 0.0, False)) for i in range(2)]  # <=64: the bucket fell back
CASES += [(260 + i, {}, ("full", 0.0, False)) for i in range(2)]  # >256: never calibrated
CASES += [(120 + i, {"full_kv": True}, ("full", 0.0, False)) for i in range(2)]
CASES += [(180 + i, {"ratio": 0.25}, ("knorm", 0.25, False)) for i in range(2)]  # stricter


def _hold_until(state, count: int):
    """A forward pre-hook that holds the first prefill until ``count`` requests are in, so they share a batch."""
    held = threading.Event()

    def gate(_m, _a, _kwargs):
        if not held.is_set():
            deadline = time.monotonic() + 30
            while state.scheduler.waiting < count - 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            held.set()

    return gate


def test_16_concurrent_clients_each_get_their_own_answer(model):
    assert len(CASES) == 16
    state = make_state(model, max_queue=16)
    question = "which letter comes next?"
    with hook(model, _hold_until(state, 16)), running(state) as url:
        c = client(url)

        def ask(i: int):
            length, options, _ = CASES[i]
            return c.chat.completions.create(model=NAME, max_tokens=10, extra_body={"kvsieve": options},
                                             messages=[{"role": "user", "content": _doc(i, length) + "\n" + question}])

        with ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(ask, range(16)))
    assert state.scheduler.peak_rows >= 12  # they decoded together, not one after another
    for i, reply in enumerate(replies):
        length, _, (policy, ratio, _) = CASES[i]
        kv = reply.usage.kv_cache
        assert (kv["policy"], kv["ratio"]) == (policy, ratio), (i, kv)
        # the same answer the engine gives this request alone at its point: nothing of another row leaks in
        alone = generate(model, ChatTokenizer(), _doc(i, length), question, get(policy), ratio=ratio,
                         max_new_tokens=10)
        assert reply.choices[0].message.content == alone.text, i
        assert kv["bytes_kept"] == alone.cache_bytes_kept and kv["bytes_full"] == alone.cache_bytes_full
    assert len({r.choices[0].message.content for r in replies}) >= 12  # the rows' answers differ
    assert state.scheduler.charged == 0 and state.scheduler.running == 0


def test_admitted_bytes_never_exceed_the_budget(model):
    budget = BYTES_PER_TOKEN * 700  # about three requests of ~190 tokens prefilled, more once compressed
    state = make_state(model, max_queue=16, kv_budget=budget)
    seen = {"charged": 0, "waited": 0, "rows": 0}

    def watch(_m, _a, kwargs):
        scheduler = state.scheduler
        seen["charged"] = max(seen["charged"], scheduler.charged)
        seen["waited"] = max(seen["waited"], scheduler.waiting)
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] == 1:
            seen["rows"] = max(seen["rows"], ids.shape[0])

    with hook(model, watch), running(state) as url:
        c = client(url)

        def ask(i: int):
            return c.chat.completions.create(model=NAME, max_tokens=20, messages=[
                {"role": "user", "content": _doc(i, 170) + "\nnext?"}])

        with ThreadPoolExecutor(10) as pool:
            replies = list(pool.map(ask, range(10)))
        metrics = httpx.get(url + "/metrics").text
    assert all(r.usage.completion_tokens == 20 for r in replies)
    assert seen["waited"] >= 1 and seen["rows"] >= 3  # the budget bound, and still let several decode at once
    assert 0 < seen["charged"] <= budget and state.scheduler.peak_charged <= budget
    assert f"kvsieve_kv_budget_bytes {budget}\n" in metrics
    assert state.scheduler.charged == 0


def test_a_disconnect_frees_its_bytes(model):
    steps = []

    def slow(_m, _a, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] == 1:  # a decoding step
            steps.append(ids.shape[0])
            time.sleep(0.01)

    state = make_state(model)
    body = {"model": NAME, "max_tokens": 300, "messages": [{"role": "user", "content": _doc(1, 150) + "\nq"}]}
    with hook(model, slow), running(state) as url:
        with httpx.stream("POST", url + "/v1/chat/completions", json=dict(body, stream=True), timeout=30) as reply:
            lines = reply.iter_lines()
            assert any(next(lines).startswith("data: ") for _ in range(4))
            assert state.scheduler.charged > 0
        _wait(lambda: state.scheduler.charged == 0 and state.scheduler.running == 0, timeout=10)
        streamed = len(steps)
        # a client of a non-streamed answer that gives up is noticed too
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", json=body, timeout=1.0)
        _wait(lambda: state.scheduler.charged == 0 and state.scheduler.running == 0, timeout=10)
        total = len(steps)
        metrics = httpx.get(url + "/metrics").text
    assert streamed < 200 and total - streamed < 200, (streamed, total)
    assert 'kvsieve_requests_total{endpoint="chat",kv_cache="certified",status="499"} 2' in metrics


def test_a_decoding_request_is_charged_its_entries_plus_its_reserve(model):
    state = make_state(model)
    during_decode: list[int] = []

    def record(_m, _a, kwargs):  # read inside a decode step, when the request is surely running, whatever the load
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] == 1:
            during_decode.append(state.scheduler.charged)

    body = {"model": NAME, "max_tokens": 100, "stream": True,
            "messages": [{"role": "user", "content": _doc(2, 150) + "\nq"}]}
    with hook(model, record), running(state) as url:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as reply:
            kept = int(reply.headers["x-kvsieve-bytes-kept"])
            reply.read()
        _wait(lambda: state.scheduler.charged == 0)
    assert during_decode and len(set(during_decode)) == 1  # charged once, at admission, for the whole answer
    charged = during_decode[0]
    question = len("q\x04\x05A:")  # read after the query-agnostic compression: one entry a token in every head
    assert kept == BYTES_PER_TOKEN * round((len("\x02user\x03") + 151) * 0.5)
    assert charged == kept + BYTES_PER_TOKEN * question + BYTES_PER_TOKEN * 100
