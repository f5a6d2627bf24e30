"""kvsieve serve against the official openai client on a random loopback port (tiny random model; SmolLM2 once)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
import torch
from conftest import CharTokenizer, tiny_model

from kvsieve.engine.generate import generate
from kvsieve.policies import from_spec, get
from kvsieve.policies.label import Point
from kvsieve.risk import Certification, CertifiedPolicy, Contract, ContractFile
from kvsieve.serve.chat_prompt import chat_prompt
from kvsieve.serve.command import build_state, point_source, serve
from kvsieve.serve.points import PointSource
from kvsieve.serve.schemas import ChatMessage

TESTS = Path(__file__).parent
NAME = "tiny-llama"
# tiny llama: 3 layers x (keys + values) x 2 KV heads x head dim 16 x 4 bytes (fp32) per cached token
BYTES_PER_TOKEN = 3 * 2 * 2 * 16 * 4


class ChatTokenizer(CharTokenizer):
    """CharTokenizer with a template that renders every message (conftest's renders the first only)."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **_):
        body = "".join(f"\x02{m['role']}\x03{m['content']}\x04" for m in messages)
        return body + ("\x05A:" if add_generation_prompt else "")


def _cert(chosen: Point | None, reason: str = "") -> Certification:
    return Certification(0.1, 0.1, 0.0, "binary", "bonferroni", 60, [], chosen, reason)


def length_contract(qa: bool = False) -> ContractFile:
    """<=64 context tokens: fell back; <=256: knorm@0.5 certified; beyond: never calibrated."""
    buckets = {"<=64": _cert(None, "no candidate certified: falling back to full KV"),
               "<=256": _cert(Point("knorm", 0.5, qa))}
    return ContractFile(Contract(), NAME, "length", [64, 256], buckets)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


@contextlib.contextmanager
def running(state, drain: float = 10.0):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = serve(state, drain_timeout=drain)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive()


def make_state(model, points: PointSource | None = None, max_queue: int = 4, kv_budget: int = 64 << 20, **extra):
    points = points or PointSource(CertifiedPolicy(length_contract(), NAME))
    return build_state(model, ChatTokenizer(), NAME, points, max_queue, context=model.config.max_position_embeddings,
                       max_tokens_limit=300, default_max_tokens=16, kv_budget=kv_budget, **extra)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


DOC = "".join(chr(97 + (i * 7) % 26) for i in range(150))  # 150 characters: ~158 context tokens


def test_chat_applies_the_certified_point_and_reports_it(model):
    state = make_state(model)
    with running(state) as url:
        raw = client(url).chat.completions.with_raw_response.create(
            model=NAME, messages=[{"role": "user", "content": DOC + "\nwhich letter?"}], max_tokens=8)
        reply = raw.parse()
    kv = reply.usage.kv_cache
    n = len("\x02user\x03") + len(DOC) + 1  # template head + document + the newline: the compressed part
    assert (kv["policy"], kv["ratio"], kv["status"], kv["certified"], kv["bucket"]) == ("knorm", 0.5, "certified",
                                                                                         True, "<=256")
    assert kv["context_tokens"] == n and kv["bytes_full"] == BYTES_PER_TOKEN * n
    assert kv["kept_tokens_per_layer"] == [round(n * 0.5)] * 3
    assert kv["bytes_kept"] == BYTES_PER_TOKEN * round(n * 0.5)
    assert kv["bytes_saved"] == kv["bytes_full"] - kv["bytes_kept"]
    assert reply.usage.prompt_tokens == n + len("which letter?\x04\x05A:") and reply.usage.completion_tokens == 8
    # the same answer as the engine on the same layout (one message = build_prompt's context + "\n" + question)
    want = generate(model, ChatTokenizer(), DOC, "which letter?", get("knorm"), ratio=0.5, max_new_tokens=8)
    assert reply.choices[0].message.content == want.text and reply.choices[0].finish_reason == "length"
    headers = raw.headers
    assert (headers["x-kvsieve-policy"], headers["x-kvsieve-ratio"], headers["x-kvsieve-status"]) == ("knorm", "0.5",
                                                                                                       "certified")
    assert int(headers["x-kvsieve-bytes-kept"]) == kv["bytes_kept"]


def test_completions_and_models(model):
    state = make_state(model)
    with running(state) as url:
        c = client(url)
        assert [m.id for m in c.models.list().data] == [NAME]
        done = c.completions.create(model=NAME, prompt=DOC + "\nnext:", max_tokens=5)
        health = httpx.get(url + "/health").json()
    assert done.choices[0].finish_reason == "length" and len(done.choices[0].text) == 5  # one char per token
    kv = done.usage.kv_cache
    assert kv["context_tokens"] == len(DOC) + 1 and kv["status"] == "certified"
    assert done.usage.prompt_tokens == len(DOC) + 1 + len("next:")
    assert health == {"status": "ok", "model": NAME, "points": "contract", "waiting": 0, "running": 0,
                      "kv_budget_bytes": 64 << 20, "kv_admitted_bytes": 0}


def test_streaming_reassembles_to_the_non_streamed_text(model):
    state = make_state(model)
    messages = [{"role": "system", "content": DOC}, {"role": "user", "content": "and the letter after?"}]
    with running(state) as url:
        c = client(url)
        whole = c.chat.completions.create(model=NAME, messages=messages, max_tokens=24)
        chunks = list(c.chat.completions.create(model=NAME, messages=messages, max_tokens=24, stream=True,
                                                stream_options={"include_usage": True}))
        free = c.completions.create(model=NAME, prompt=DOC + "\nx", max_tokens=30).choices[0].text
        stop = free[12:14]  # two characters the unstopped answer reaches: the stopped one must end before them
        stop_whole = c.completions.create(model=NAME, prompt=DOC + "\nx", max_tokens=30, stop=[stop])
        stop_stream = list(c.completions.create(model=NAME, prompt=DOC + "\nx", max_tokens=30, stop=[stop],
                                                stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content and len(chunks) > 3
    assert chunks[-1].choices == [] and chunks[-1].usage.kv_cache == whole.usage.kv_cache
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert "".join(ch.choices[0].text for ch in stop_stream) == stop_whole.choices[0].text
    assert stop_whole.choices[0].text == free[: free.index(stop)] and stop_whole.choices[0].finish_reason == "stop"


def test_each_bucket_gets_its_point_and_full_kv_fallbacks_are_reported(model):
    state = make_state(model)
    with running(state) as url:
        c = client(url)

        def kv(doc: str, **extra) -> dict:
            reply = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": doc + "\nq?"}],
                                              max_tokens=2, **extra)
            return reply.usage.kv_cache

        short, middle, long = kv("x" * 40), kv(DOC), kv("y" * 300)
        full = kv(DOC, extra_body={"kvsieve": {"full_kv": True}})
        stricter = kv(DOC, extra_body={"kvsieve": {"ratio": 0.25}})
        with pytest.raises(openai.BadRequestError, match=r"knorm@0.75 is looser .* allowed: full KV, or knorm at a "
                                                         r"ratio <= 0.5"):
            kv(DOC, extra_body={"kvsieve": {"ratio": 0.75}})
        with pytest.raises(openai.BadRequestError, match=r"kvsieve.policy 'snapkv' is not a point this server runs; "
                                                         r"allowed: knorm \(ratio <= 0.5\), or kvsieve.full_kv"):
            kv(DOC, extra_body={"kvsieve": {"policy": "snapkv"}})
        with pytest.raises(openai.BadRequestError, match="full KV only"):
            kv("x" * 40, extra_body={"kvsieve": {"ratio": 0.1, "policy": "knorm"}})
    assert (short["bucket"], short["status"], short["policy"]) == ("<=64", "fallback", "full")
    assert "no candidate certified" in short["reason"] and short["bytes_kept"] == short["bytes_full"]
    assert (middle["bucket"], middle["status"], middle["ratio"]) == ("<=256", "certified", 0.5)
    assert (long["bucket"], long["status"]) == (">256", "fallback") and "was not calibrated" in long["reason"]
    assert long["kept_tokens_per_layer"] == [long["context_tokens"]] * 3
    assert full["status"] == "full_requested" and full["bytes_kept"] == full["bytes_full"] == middle["bytes_full"]
    n = middle["context_tokens"]
    assert stricter["status"] == "stricter" and not stricter["certified"]
    assert stricter["kept_tokens_per_layer"] == [round(n * 0.75)] * 3


def test_question_aware_point_keeps_the_question(model):
    state = make_state(model, PointSource(CertifiedPolicy(length_contract(qa=True), NAME)))
    with running(state) as url:
        reply = client(url).chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": DOC + "\nwhich letter?"}], max_tokens=4)
    kv, n, m = reply.usage.kv_cache, len(DOC) + 7, len("which letter?\x04\x05A:")
    assert kv["question_aware"] and kv["kept_tokens_per_layer"] == [round(n * 0.5) + m] * 3
    want = generate(model, ChatTokenizer(), DOC, "which letter?", get("knorm"), ratio=0.5, question_aware=True,
                    max_new_tokens=4)
    assert reply.choices[0].message.content == want.text


def test_fixed_policy_is_marked_uncertified_and_no_policy_is_full(model):
    with running(make_state(model, point_source(NAME, policy="knorm", ratio=0.25))) as url:
        fixed = client(url).completions.create(model=NAME, prompt=DOC + "\nq", max_tokens=2).usage.kv_cache
    with running(make_state(model, point_source(NAME))) as url:
        full = client(url).completions.create(model=NAME, prompt=DOC + "\nq", max_tokens=2).usage.kv_cache
    assert (fixed["status"], fixed["certified"], fixed["ratio"]) == ("uncertified", False, 0.25)
    assert (full["status"], full["policy"], full["contract"]) == ("full", "full", None)


def test_the_server_refuses_a_contract_for_another_model(tmp_path):
    path = length_contract().write(tmp_path / "c.json")
    with pytest.raises(ValueError, match="certified for model 'tiny-llama', not 'smollm2-135m'"):
        point_source("smollm2-135m", contract=str(path))
    nominal = ContractFile(Contract(), NAME, "length", [64], {"<=64": _cert(None)}, length_quantity="nominal")
    with pytest.raises(ValueError, match="recertify"):
        point_source(NAME, contract=str(nominal.write(tmp_path / "n.json")))
    with pytest.raises(ValueError, match="--policy needs --ratio"):
        point_source(NAME, policy="knorm")


BAD = [  # (body, status, code or None, words the message must hold)
    (b"{not json", 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "must be a JSON object, got list"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokenz": 4}, 422, "invalid_value",
     "unknown field 'max_tokenz'; allowed: frequency_penalty, kvsieve, logprobs, max_completion_tokens, max_tokens"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "8"}, 422, "invalid_value",
     "max_tokens: Input should be a valid integer"),
    ({"model": NAME, "messages": [{"role": "robot", "content": "hi"}]}, 422, "invalid_value", "messages.0.role"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "kvsieve": {"tsak": "niah"}}, 422,
     "invalid_value", "unknown field 'kvsieve.tsak'; allowed: full_kv, policy, ratio, task"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "invalid_value",
     "max_tokens 0 is out of range: allowed 1..300 (the server's --max-tokens-limit (300))"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 200}, 400, "invalid_value",
     "max_tokens 200 is out of range: allowed 1..102 (the model's context (512) minus the prompt (410))"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x" * 600}]}, 400, "context_length_exceeded",
     "the prompt is 610 tokens; the model's context is 512 tokens"),
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 400, "model_not_found",
     "model 'gpt-4o' is not served here; this server serves 'tiny-llama'"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "temperature": 0.7}, 400, None,
     "temperature 0.7 is not supported"),
    ({"model": NAME, "messages": [{"role": "system", "content": "hi"}]}, 400, None, "has no user turn"),
    ({"model": NAME, "messages": [{"role": "user", "content": DOC + "\nq"}], "kvsieve": {"ratio": 1.5}}, 400, None,
     "kvsieve.ratio 1.5 is out of range: a compression ratio is in [0, 1)"),
]


def test_every_bad_request_gets_its_status_and_a_message_naming_the_value(model):
    state = make_state(model)
    with running(state) as url:
        for body, status, code, words in BAD:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            reply = httpx.post(url + "/v1/chat/completions", content=content,
                               headers={"content-type": "application/json"}, timeout=30)
            assert reply.status_code == status, (body, reply.text)
            error = reply.json()["error"]
            assert words in error["message"], (words, error)
            assert code is None or error["code"] == code
            assert error["type"] == "invalid_request_error"
        with pytest.raises(openai.UnprocessableEntityError, match="unknown field 'top_k'"):
            client(url).chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                extra_body={"top_k": 3})
        missing = httpx.get(url + "/v2/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "Not Found"


@contextlib.contextmanager
def hook(model, fn):
    handle = model.register_forward_pre_hook(fn, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _has(kwargs, char: str) -> bool:
    ids = kwargs.get("input_ids")
    return ids is not None and bool((ids == ord(char)).any())


def test_an_exception_inside_one_request_answers_500_and_the_server_keeps_serving(model):
    def explode(_m, _a, kwargs):
        if _has(kwargs, "!"):
            raise RuntimeError("injected fault")

    state = make_state(model)
    with hook(model, explode), running(state) as url:
        c = client(url)
        with pytest.raises(openai.InternalServerError, match="RuntimeError: injected fault"):
            c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": DOC + "!\nq"}], max_tokens=3)
        with pytest.raises(openai.InternalServerError, match="injected fault"):
            list(c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": DOC + "!\nq"}],
                                           max_tokens=3, stream=True))
        ok = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": DOC + "\nq"}], max_tokens=3)
        metrics = httpx.get(url + "/metrics").text
    assert ok.usage.completion_tokens == 3
    assert 'kvsieve_requests_total{endpoint="chat",kv_cache="certified",status="500"} 2' in metrics
    assert 'kvsieve_requests_total{endpoint="chat",kv_cache="certified",status="200"} 1' in metrics


def test_a_full_budget_answers_429_with_retry_after(model):
    gate = threading.Event()

    def hold(_m, _a, kwargs):
        if _has(kwargs, "#"):
            assert gate.wait(30)

    # room for one request of ~165 tokens (prompt + max_tokens), not two: the second waits, the third is refused
    state = make_state(model, max_queue=1, kv_budget=BYTES_PER_TOKEN * 200)
    results: dict[str, object] = {}
    with hook(model, hold), running(state) as url:
        c = client(url)

        def ask(key: str, doc: str) -> None:
            results[key] = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": doc + "\nq"}],
                                                     max_tokens=2)

        first = threading.Thread(target=ask, args=("first", DOC + "#"))
        first.start()
        _wait(lambda: state.scheduler.running == 1)
        second = threading.Thread(target=ask, args=("second", DOC))
        second.start()
        _wait(lambda: state.scheduler.waiting == 1)
        refused = httpx.post(url + "/v1/chat/completions", json={"model": NAME, "max_tokens": 2,
                                                                 "messages": [{"role": "user", "content": "hi"}]})
        gate.set()
        first.join(30)
        second.join(30)
        metrics = httpx.get(url + "/metrics").text
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "kv_budget_full" and "the KV budget is full" in refused.text
    assert "1 waiting" in refused.text and f"of {BYTES_PER_TOKEN * 200} bytes admitted" in refused.text
    assert results["first"].usage.completion_tokens == 2 and results["second"].usage.completion_tokens == 2
    assert 'kvsieve_requests_total{endpoint="chat",kv_cache="none",status="429"} 1' in metrics
    assert state.scheduler.peak_charged <= BYTES_PER_TOKEN * 200 and state.scheduler.charged == 0


def _wait(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_a_client_that_disconnects_mid_stream_frees_its_bytes(model):
    steps = []

    def slow(_m, _a, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] == 1:  # a decoding step
            steps.append(1)
            time.sleep(0.01)

    state = make_state(model)
    body = {"model": NAME, "max_tokens": 300, "stream": True,
            "messages": [{"role": "user", "content": DOC + "\nq"}]}
    with hook(model, slow), running(state) as url:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as reply:
            assert reply.status_code == 200
            lines = reply.iter_lines()
            got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        _wait(lambda: state.scheduler.running == 0, timeout=10)
        decoded = len(steps)
        time.sleep(0.2)
        after = client(url).chat.completions.create(model=NAME, messages=[{"role": "user", "content": DOC + "\nq"}],
                                                    max_tokens=2)
        metrics = httpx.get(url + "/metrics").text
    assert decoded < 200, f"decoding went on after the client left ({decoded} steps of 300)"
    assert after.usage.completion_tokens == 2
    assert 'kvsieve_requests_total{endpoint="chat",kv_cache="certified",status="499"} 1' in metrics


def test_metrics_count_requests_tokens_and_bytes(model):
    state = make_state(model)
    with running(state) as url:
        c = client(url)
        usages = [c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": doc + "\nq"}],
                                            max_tokens=3).usage for doc in (DOC, "x" * 40)]
        text = httpx.get(url + "/metrics").text
    saved = sum(u.kv_cache["bytes_saved"] for u in usages)
    assert saved > 0 and f"kvsieve_kv_bytes_saved_total {saved}\n" in text
    assert f"kvsieve_prompt_tokens_total {sum(u.prompt_tokens for u in usages)}" in text
    assert "kvsieve_completion_tokens_total 6" in text
    assert "kvsieve_request_seconds_count 2" in text and "kvsieve_time_to_first_token_seconds_count 2" in text
    assert "# TYPE kvsieve_request_seconds histogram" in text and 'kvsieve_request_seconds_bucket{le="+Inf"} 2' in text


def test_one_message_splits_like_build_prompt():
    from kvsieve.prompt import build_prompt

    tok = ChatTokenizer()
    got = chat_prompt(tok, [ChatMessage(role="user", content="some context\nmore\nthe question")])
    want = build_prompt(tok, "some context\nmore", "the question")
    assert torch.equal(got.context_ids, want.context_ids) and torch.equal(got.question_ids, want.question_ids)
    turns = chat_prompt(tok, [ChatMessage(role="user", content="a\nb"), ChatMessage(role="assistant", content="ok"),
                              ChatMessage(role="user", content="last\nturn")])
    assert tok.decode(turns.question_ids[0].tolist()) == "last\nturn\x04\x05A:"  # a later turn is the question whole


SERVER = textwrap.dedent("""
    import socket, sys, time
    sys.path[:0] = [sys.argv[1], sys.argv[2]]  # test_serve's folder, and the tests' root for conftest
    from test_serve import ChatTokenizer, NAME
    from conftest import tiny_model
    from kvsieve.serve.command import build_state, point_source, serve
    model = tiny_model("llama", seed=3)
    def slow(_m, _a, kwargs):
        if kwargs["input_ids"].shape[1] == 1:
            time.sleep(0.02)
    model.register_forward_pre_hook(slow, with_kwargs=True)
    state = build_state(model, ChatTokenizer(), NAME, point_source(NAME, policy="knorm", ratio=0.5), 4, context=512)
    sock = socket.socket(); sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    serve(state, drain_timeout=30).run(sockets=[sock])
""")


def test_sigterm_drains_in_flight_requests_then_exits(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(TESTS), str(TESTS.parent)], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        port = int(proc.stdout.readline())
        url = f"http://127.0.0.1:{port}"
        _wait(lambda: _up(url), timeout=60)
        result: dict = {}

        def ask(i: int) -> None:
            result[i] = client(url).completions.create(model=NAME, prompt=DOC[i:] + "\nq", max_tokens=60)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        _wait(lambda: httpx.get(url + "/health").json()["running"] == 3)  # three rows decoding in one batch
        proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(60)
        code = proc.wait(60)
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [result[i].usage.completion_tokens for i in range(3)] == [60] * 3  # in flight at SIGTERM, all finished
    # uvicorn re-raises the captured SIGTERM once it has drained, so the exit is the signal's (143 in a shell)
    assert code in (0, -signal.SIGTERM), (code, out)


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.model
def test_smollm2_chat_end_to_end_with_a_contract_from_the_shipped_store(smollm2, tmp_path):
    from kvsieve.harness.store import ResultsStore
    from kvsieve.risk import certify_buckets, loss_table

    store = Path(__file__).parents[2] / "results" / "smollm2-2k.sqlite"
    with ResultsStore(store) as s:
        table = loss_table(s, "smollm2-135m-instruct", [Point("knorm", 0.25), Point("tova", 0.25)])
    contract = certify_buckets(table, Contract(alpha=0.3, delta=0.1), "smollm2-135m-instruct")
    chosen = contract.buckets["all"].chosen
    assert chosen is not None
    path = contract.write(tmp_path / "contract.json")
    model, tokenizer = smollm2
    state = build_state(model, tokenizer, "smollm2-135m-instruct", point_source("smollm2-135m", contract=str(path)),
                        max_tokens_limit=64)
    context = ("Notes from the archive. " * 12 + "The special magic number for the blue door is 7423. "
               + "The records continue without change. " * 12)
    question = "What is the special magic number for the blue door?"
    with running(state) as url:
        reply = client(url).chat.completions.create(model="smollm2-135m",
                                                    messages=[{"role": "user", "content": context + "\n" + question}],
                                                    max_tokens=16)
    kv = reply.usage.kv_cache
    assert (kv["policy"], kv["ratio"], kv["status"]) == (chosen.policy, chosen.ratio, "certified")
    assert len(kv["kept_tokens_per_layer"]) == 30 and kv["bytes_kept"] < kv["bytes_full"]
    want = generate(model, tokenizer, context, question, from_spec(chosen.policy), ratio=chosen.ratio,
                    max_new_tokens=16)
    assert reply.choices[0].message.content == want.text
