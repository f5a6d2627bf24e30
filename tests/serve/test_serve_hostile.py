"""No request freezes or breaks kvsieve serve: the reproducers of issue 49, each a request the landed server froze on,
answered 500, or answered with a megabyte (tiny random llama, char tokenizer; see test_serve.py)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time

import httpx2 as httpx
import pytest
from conftest import tiny_model
from test_serve import DOC, NAME, _cert, _wait, client, hook, make_state, running

from kvsieve.policies.label import Point
from kvsieve.risk import CertifiedPolicy, Contract, ContractFile
from kvsieve.serve.points import PointSource
from kvsieve.serve.schemas import ChatCompletionRequest, CompletionRequest, json_depth, parse_body


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


def _post(url: str, body: bytes | dict, path: str = "/v1/chat/completions") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=60)


def _nesting(value) -> int:
    """How deep a parsed JSON value nests arrays and objects: the independent count json_depth must match."""
    if isinstance(value, list):
        return 1 + max((_nesting(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_nesting(v) for v in value.values()), default=0)
    return 0


def _random_value(rng: random.Random, depth: int = 0):
    pick = rng.random()
    if depth > 6 or pick < 0.3:  # strings full of what a scanner could mistake: quotes, brackets, backslashes
        return rng.choice(['a"[{\\', "\\\\", "}]", '"""\\', "\\u005b", "\u00e9[", 1, None, 2.5])
    if pick < 0.65:
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(['k[', '"{', "\\", "]"]) + str(i): _random_value(rng, depth + 1)
            for i in range(rng.randint(0, 3))}


def test_json_depth_counts_what_the_parser_nests():
    rng = random.Random(0)
    for _ in range(2000):
        value = _random_value(rng)
        raw = json.dumps(value, ensure_ascii=rng.random() < 0.5).encode()
        assert json_depth(raw) == _nesting(value), raw


def test_a_never_closed_string_of_escaped_quotes_is_refused_at_once(model):
    """The landed depth check stripped strings with a regex that backtracks quadratically on an unclosed string of
    escaped quotes: 60 KB froze the server for 30 s (it holds the GIL, so /health waited too), and the 4 MiB limit
    allowed about 40 hours. The check is linear now: a 1 MiB body (hours for the regex) is answered, and /health with
    it; the watchdog's minutes are a bound of complexity, not a speed test."""
    body = b'{"model": "' + b'a\\"' * 350_000  # ~1 MiB, never closed
    # in a child process: the regex held the GIL, so a thread could not even time it out
    code = "import sys; from kvsieve.serve.schemas import json_depth; print(json_depth(sys.stdin.buffer.read()))"
    done = subprocess.run([sys.executable, "-c", code], input=body, capture_output=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == b"1", done.stderr
    assert json_depth(body) == 1
    state = make_state(model)
    with running(state) as url:
        reply = _post(url, body[:60_000])
        health = httpx.get(url + "/health", timeout=60)
    assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"]["message"]
    assert health.status_code == 200


LONE = '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "%s"}]%s}'


@pytest.mark.parametrize(("body", "field"), [
    (LONE % (NAME, DOC + "\\nq\\ud800", ""), "messages.0.content"),
    (LONE % (NAME, DOC + "\\nq", ', "stop": ["a", "\\udc00b"]'), "stop.1"),
    (LONE % (NAME + "\\ud800", DOC + "\\nq", ""), "model"),
    ('{"model": "' + NAME + '", "max_tokens": 2, "prompt": "' + DOC + '\\nq\\ud83d"}', "prompt"),
    (LONE % (NAME, "x", ', "kvsieve": {"task": "\\ud800"}'), "kvsieve.task"),
])
def test_a_lone_surrogate_is_refused_naming_its_field(model, body, field):
    """``"\\ud800"`` is valid JSON but no Unicode scalar value: the landed server answered 500 (the tokenizer's
    TypeError: TextEncodeInput must be ...)."""
    state = make_state(model)
    path = "/v1/completions" if '"prompt"' in body else "/v1/chat/completions"
    with running(state) as url:
        reply = _post(url, body.encode(), path)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == field and f"{field} holds a lone UTF-16 surrogate" in error["message"]
    # a surrogate pair escapes one real character (U+1F600): text like any other
    paired = parse_body(body.replace("\\ud800", "\\ud83d\\ude00").replace("\\udc00", "\\ud83d\\ude00")
                        .replace("\\ud83d\"", "\\ud83d\\ude00\"").encode(),
                        CompletionRequest if '"prompt"' in body else ChatCompletionRequest)
    assert "\U0001F600" in json.dumps(paired.model_dump(), ensure_ascii=False)


def _task_state(model):
    buckets = {"niah_single_1": _cert(Point("knorm", 0.5)), "vt": _cert(None, "no candidate certified")}
    return make_state(model, PointSource(CertifiedPolicy(ContractFile(Contract(), NAME, "task", [], buckets), NAME)))


@pytest.mark.parametrize("task", ["\U0001F600", "niah\r\nx-evil: 1", "a\x00b", "t" * 10_000, "niah_single_2"])
def test_kvsieve_task_is_checked_against_the_contract_before_anything_runs(model, task):
    """The landed server copied ``kvsieve.task`` unchecked into the x-kvsieve-bucket header after generating: an
    emoji answered 500, CR/LF or NUL closed the connection with no answer, 10 KB made a 10 KB header, and each was
    counted in /metrics as both 200 and 500. An uncalibrated task now gets 400 too, naming the contract's tasks."""
    state = _task_state(model)
    forwards = []
    body = {"model": NAME, "max_tokens": 2, "messages": [{"role": "user", "content": DOC + "\nq"}],
            "kvsieve": {"task": task}}
    with hook(model, lambda *_a: forwards.append(1)), running(state) as url:
        reply = _post(url, body)
        good = client(url).chat.completions.with_raw_response.create(
            model=NAME, max_tokens=2, messages=[{"role": "user", "content": DOC + "\nq"}],
            extra_body={"kvsieve": {"task": "niah_single_1"}})
        metrics = httpx.get(url + "/metrics").text
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "kvsieve.task" and len(reply.content) < 500
    assert "is not in this server's contract; allowed: a task one of niah_single_1, vt" in error["message"]
    assert good.headers["x-kvsieve-bucket"] == "niah_single_1" and good.parse().usage.kv_cache["ratio"] == 0.5
    assert len(forwards) == 3  # the good request: its context, its question, one decode step; none for the refused
    assert 'status="500"' not in metrics
    assert 'kvsieve_requests_total{endpoint="chat",kv_cache="none",status="400"} 1' in metrics


def test_a_queued_stream_whose_client_leaves_is_never_prefilled(model):
    """The landed server noticed a non-streamed client leaving while queued, not a streamed one: its request was
    prefilled later for nobody."""
    gate, prefilled = threading.Event(), []

    def watch(_m, _a, kwargs):
        ids = kwargs["input_ids"]
        if kwargs.get("position_ids") is None:
            prefilled.append(bytes(ids[0].tolist()))
        if bool((ids == ord("#")).any()):
            assert gate.wait(30)

    # room for one request at a time: the second waits in the queue
    state = make_state(model, kv_budget=(len(DOC) + 40) * 2 * 768)
    with hook(model, watch), running(state) as url:
        first = threading.Thread(target=lambda: client(url).chat.completions.create(
            model=NAME, max_tokens=2, messages=[{"role": "user", "content": DOC + "#\nq"}]))
        first.start()
        _wait(lambda: state.scheduler.running == 1)
        body = {"model": NAME, "max_tokens": 2, "stream": True,
                "messages": [{"role": "user", "content": DOC.upper() + "\nq"}]}
        with pytest.raises(httpx.ReadTimeout):
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=1.5) as reply:
                reply.read()
        queued = list(state.scheduler._waiting)
        # noticed while the first request is still held in its prefill
        _wait(lambda: len(queued) == 1 and queued[0].cancelled.is_set(), timeout=10)
        gate.set()
        first.join(30)
        _wait(lambda: state.scheduler.waiting == 0)
        metrics = httpx.get(url + "/metrics").text
    assert len(prefilled) >= 1 and not any(b"Z" in p for p in prefilled)  # the second (upper case) never read
    assert 'kvsieve_requests_total{endpoint="chat",kv_cache="certified",status="499"} 1' in metrics
    assert state.scheduler.charged == 0


def test_past_the_drain_timeout_in_flight_requests_get_503_draining_with_retry_after(model):
    """The landed server let uvicorn cancel them: a bare 500 (counted 499)."""
    def slow(_m, _a, kwargs):
        if kwargs.get("position_ids") is not None:
            time.sleep(0.05)  # 300 decode steps: 15 s, far past the 1 s drain timeout

    state = make_state(model)
    results: dict = {}
    body = {"model": NAME, "max_tokens": 300, "messages": [{"role": "user", "content": DOC + "\nq"}]}
    with hook(model, slow):
        with running(state, drain=1.0) as url:
            def plain():
                results["plain"] = _post(url, body)

            def streamed():
                with httpx.stream("POST", url + "/v1/chat/completions", json=dict(body, stream=True),
                                  timeout=60) as reply:
                    results["stream"] = (reply.status_code, [line for line in reply.iter_lines() if line])

            threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
            for thread in threads:
                thread.start()
            _wait(lambda: state.scheduler.running == 2 and state.scheduler.steps > 2)
            started = time.monotonic()
        waited = time.monotonic() - started  # leaving the block stops the server: it drains
        for thread in threads:
            thread.join(30)
    plain = results["plain"]
    assert plain.status_code == 503, plain.text
    assert plain.headers["retry-after"] == "10" and plain.json()["error"]["code"] == "draining"
    assert "--drain-timeout (1 s) passed before this request finished" in plain.json()["error"]["message"]
    status, lines = results["stream"]  # its 200 was sent long ago: the stream ends with the error event
    assert status == 200 and json.loads(lines[-1][len("data: "):])["error"]["code"] == "draining"
    assert waited < 12  # well before the 15 s the requests needed: they were cut at the drain timeout
    assert state.scheduler.charged == 0


def test_echoed_client_values_are_cut_to_a_short_prefix(model):
    """A 1 MB model name and 100 stop strings were echoed whole in the 400."""
    state = make_state(model)
    with running(state) as url:
        huge = _post(url, {"model": "m" * 1_000_000, "messages": [{"role": "user", "content": "hi"}]})
        stops = _post(url, {"model": NAME, "stop": [f"stop-{i}" for i in range(100)],
                            "messages": [{"role": "user", "content": "hi"}]})
        field = _post(url, {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "k" * 100_000: 1})
    assert huge.status_code == 400 and len(huge.content) < 500, len(huge.content)
    assert "model 'mmmm" in huge.json()["error"]["message"] and "(1000000 characters)" in huge.text
    assert stops.status_code == 400 and len(stops.content) < 500
    assert "stop must be up to 4 non-empty strings, got 100 strings" in stops.json()["error"]["message"]
    assert field.status_code == 422 and len(field.content) < 1000 and "(100000 characters)" in field.text


def test_an_empty_body_is_named_empty(model):
    """An empty body was answered "must be a JSON object, got NoneType" (issue 70): it says what is missing now."""
    state = make_state(model)
    with running(state) as url:
        reply = _post(url, b"")
    assert reply.status_code == 400 and "the request body is empty" in reply.json()["error"]["message"]
    assert "NoneType" not in reply.json()["error"]["message"]
