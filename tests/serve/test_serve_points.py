"""kvsieve serve: the certified point as a built object, and a server no request can probe, stall or break.

Tiny random llama and a char tokenizer (see test_serve.py); programs read ``f.surrogate`` through a random kvzap
bound the way the shipped one is.
"""

from __future__ import annotations

import builtins
import hashlib
import io
import json
import os
import threading
import time
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
from conftest import random_kvzap, tiny_model
from test_serve import BYTES_PER_TOKEN, DOC, NAME, ChatTokenizer, _cert, client, make_state, running

import kvsieve.policies.program as program_module
from kvsieve.engine.generate import generate
from kvsieve.policies import get, parse
from kvsieve.policies.kvzap import KVzap
from kvsieve.policies.label import Point
from kvsieve.risk import CertifiedPolicy, Contract, ContractFile
from kvsieve.serve.command import point_source

SURROGATE_PROGRAM = '''SELECTION = {'chunk_size': 1, 'sink': 0, 'allocation': 'global', 'normalization': 'none'}

def score(f):
    return f.surrogate + 0.1 * unit_mean(group_mean(f.last_attn))
'''
PLAIN_PROGRAM = '''SELECTION = {"chunk_size": 1, "sink": 0}

def score(f):
    return group_mean(f.last_attn)
'''


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


@pytest.fixture
def surrogate(model, tmp_path, monkeypatch):
    """A program reading f.surrogate, with a random kvzap standing in for the model's shipped surrogate."""
    checkpoint = random_kvzap(model, tmp_path / "kvzap.safetensors", name=NAME)
    bound: list[object] = []

    def shipped(live, name=None):  # what check_model binds: the model's own surrogate
        bound.append(live)
        found = KVzap(checkpoint=str(checkpoint))
        found.check_model(live, name)
        return found

    monkeypatch.setattr(program_module, "shipped_kvzap_for", shipped)
    path = tmp_path / "best.py"
    path.write_text(SURROGATE_PROGRAM)
    return path, bound


def _contract(spec: str, ratio: float = 0.5) -> ContractFile:
    return ContractFile(Contract(), NAME, "none", [], {"all": _cert(Point(spec, ratio))})


def test_the_contract_records_each_points_spec_and_file_digest(tmp_path):
    path = tmp_path / "p.py"
    path.write_text(PLAIN_PROGRAM)
    written = _contract(f"program:{path}").write(tmp_path / "c.json")
    points = json.loads(written.read_text())["points"]
    assert points == {f"program:{path}": {"family": "program", "params": {"path": str(path)},
                                          "digest": hashlib.sha256(PLAIN_PROGRAM.encode()).hexdigest()}}
    knorm = json.loads(_contract("knorm").write(tmp_path / "k.json").read_text())["points"]
    assert knorm == {"knorm": {"family": "knorm", "params": {}, "digest": None}}


def test_a_surrogate_reading_program_serves_under_a_contract(model, surrogate, tmp_path):
    path, bound = surrogate
    spec = f"program:{path}"
    contract = _contract(spec).write(tmp_path / "c.json")
    state = make_state(model, point_source(NAME, contract=str(contract)))
    assert bound == [model]  # bound once, at start-up, to the served model
    with running(state) as url:
        c = client(url)
        replies = [c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": DOC + "\nwhich?"}],
                                             max_tokens=6) for _ in range(2)]
    kv = replies[0].usage.kv_cache
    assert (kv["policy"], kv["ratio"], kv["status"]) == (spec, 0.5, "certified") and kv["bytes_kept"] < kv["bytes_full"]
    assert bound == [model]  # no request built or bound the policy again
    policy = parse(spec).build()
    policy.check_model(model, NAME)
    want = generate(model, ChatTokenizer(), DOC, "which?", policy, ratio=0.5, max_new_tokens=6)
    assert [r.choices[0].message.content for r in replies] == [want.text] * 2
    # CertifiedPolicy.generate binds the surrogate the same way
    got = CertifiedPolicy.from_contract(contract, NAME).generate(model, ChatTokenizer(), DOC, "which?",
                                                                 max_new_tokens=6)
    assert got.token_ids == want.token_ids and got.cache_bytes_kept == want.cache_bytes_kept


def test_a_changed_or_missing_program_file_is_refused_at_start_up(tmp_path):
    path = tmp_path / "p.py"
    path.write_text(PLAIN_PROGRAM)
    contract = _contract(f"program:{path}").write(tmp_path / "c.json")
    assert point_source(NAME, contract=str(contract)).kind == "contract"
    path.write_text(PLAIN_PROGRAM + "# edited after certification\n")
    with pytest.raises(ValueError, match=r"file sha256 [0-9a-f]{12}, but the file now has sha256 [0-9a-f]{12}: it "
                                         r"changed after certification"):
        point_source(NAME, contract=str(contract))
    path.unlink()
    with pytest.raises(ValueError, match=rf"certifies policy 'program:{path}', which cannot be loaded here: .*does not "
                                         "exist .*relative paths resolve against the working directory"):
        point_source(NAME, contract=str(contract))
    # a contract written before digests: a file-defined point is refused, a plain one is served
    path.write_text(PLAIN_PROGRAM)
    data = json.loads(contract.read_text())
    del data["points"]
    contract.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="records no digest of that file .*recertify"):
        point_source(NAME, contract=str(contract))
    old = json.loads(_contract("knorm").write(tmp_path / "k.json").read_text())
    del old["points"]
    (tmp_path / "k.json").write_text(json.dumps(old))
    assert point_source(NAME, contract=str(tmp_path / "k.json")).base(None, 100).point.policy.name == "knorm"


class _Spy:
    """Records every open() and stat() of a path containing ``needle`` (how a file is read or probed)."""

    def __init__(self, needle: str, monkeypatch) -> None:
        self.needle, self.seen = needle, []
        real_open, real_stat = io.open, os.stat

        def spy_open(file, *args, **kwargs):
            self._note(file)
            return real_open(file, *args, **kwargs)

        def spy_stat(path, *args, **kwargs):
            self._note(path)
            return real_stat(path, *args, **kwargs)

        monkeypatch.setattr(io, "open", spy_open)  # Path.open, read_bytes and read_text go through io.open
        monkeypatch.setattr(builtins, "open", spy_open)
        monkeypatch.setattr(os, "stat", spy_stat)  # Path.is_file / exists: how a file is probed

    def _note(self, path) -> None:
        if isinstance(path, (str, bytes, os.PathLike)) and self.needle in os.fsdecode(path):
            self.seen.append(os.fsdecode(path))


def test_no_client_choice_opens_a_path(model, tmp_path, monkeypatch):
    secret = tmp_path / "probe-secret"
    secret.mkdir()
    (secret / "best.py").write_text(PLAIN_PROGRAM)
    (secret / "policy.safetensors").write_bytes(b"\0" * 64)
    probes = [f"program:{secret}/best.py", f"program:{secret}/missing.py", f"learned(checkpoint='{secret}')",
              f"kvzap(checkpoint='{secret}/policy.safetensors')", "program:/etc/shadow", "snapkv(window=",
              "x" * 5000]
    state = make_state(model, point_source(NAME, policy="knorm", ratio=0.5, allow_override=True))
    with running(state) as url:
        spy = _Spy("probe-secret", monkeypatch)
        c = client(url)
        for probe in probes:
            with pytest.raises(openai.BadRequestError) as refused:
                c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": DOC + "\nq"}],
                                          max_tokens=2, extra_body={"kvsieve": {"policy": probe, "ratio": 0.25}})
            message = refused.value.body["message"]
            assert "is not a point this server runs; allowed: knorm (ratio <= 0.5), or kvsieve.full_kv" in message
            assert "exist" not in message and len(message) < 300
        allowed = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": DOC + "\nq"}],
                                            max_tokens=2, extra_body={"kvsieve": {"policy": "knorm", "ratio": 0.75}})
    assert spy.seen == []
    assert allowed.usage.kv_cache["status"] == "override" and allowed.usage.kv_cache["ratio"] == 0.75


def test_a_policy_failing_at_run_time_is_answered_at_full_kv(model, tmp_path):
    path = tmp_path / "p.py"
    path.write_text(PLAIN_PROGRAM)
    spec = f"program(path='{path}', max_elements=8)"  # the interpreter stops it on the first layer
    state = make_state(model, point_source(NAME, contract=str(_contract(spec).write(tmp_path / "c.json"))))
    with running(state) as url:
        c = client(url)
        reply = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": DOC + "\nwhich?"}],
                                          max_tokens=5)
        chunks = list(c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": DOC + "\nwhich?"}],
                                                max_tokens=5, stream=True))
        metrics = httpx.get(url + "/metrics").text
    kv = reply.usage.kv_cache
    assert (kv["status"], kv["policy"], kv["ratio"], kv["certified"]) == ("fallback", "full", 0.0, False)
    assert f"policy {spec}@0.5 failed while compressing" in kv["reason"] and "answered at full KV" in kv["reason"]
    assert kv["bytes_kept"] == kv["bytes_full"]
    want = generate(model, ChatTokenizer(), DOC, "which?", get("full"), max_new_tokens=5)
    assert reply.choices[0].message.content == want.text
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.text
    assert chunks[-1].usage.kv_cache["status"] == "fallback"
    assert 'kvsieve_requests_total{endpoint="chat",kv_cache="fallback",status="200"} 2' in metrics
    assert "kvsieve_policy_failures_total 2" in metrics


def test_a_large_body_is_refused_and_does_not_stall_the_server(model):
    state = make_state(model, max_body_bytes=64 << 10)
    big = json.dumps({"model": NAME, "messages": [{"role": "user", "content": "x" * (100 << 10)}]}).encode()
    with running(state) as url:
        declared = httpx.post(url + "/v1/chat/completions", content=big, headers={"content-type": "application/json"})
        chunked = httpx.post(url + "/v1/chat/completions", content=iter([big[:50000], big[50000:]]),
                             headers={"content-type": "application/json"})
        metrics = httpx.get(url + "/metrics").text
    assert declared.status_code == 413 and chunked.status_code == 413
    assert declared.json()["error"]["message"] == (f"the request body is {len(big)} bytes; this server accepts at "
                                                   f"most {64 << 10} (--max-body-mb)")
    assert 'kvsieve_requests_total{endpoint="chat",kv_cache="none",status="413"} 2' in metrics


class _SlowTokenizer(ChatTokenizer):
    """Takes two seconds over a text holding 'slow', and says when it started."""

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()

    def __call__(self, text, **kwargs):
        if "slow" in text:
            self.started.set()
            time.sleep(2.0)
        return super().__call__(text, **kwargs)


def test_tokenizing_runs_off_the_event_loop(model):
    state = make_state(model)
    state.tokenizer = _SlowTokenizer()
    with running(state) as url:
        result = {}
        thread = threading.Thread(target=lambda: result.update(reply=client(url).chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": DOC + " slow\nq"}], max_tokens=2)))
        thread.start()
        assert state.tokenizer.started.wait(30)
        start = time.perf_counter()
        health = httpx.get(url + "/health", timeout=30)
        waited = time.perf_counter() - start
        thread.join(60)
    assert health.status_code == 200 and waited < 1.0, waited
    assert result["reply"].usage.completion_tokens == 2


def test_deep_json_and_the_question_marker_are_refused_or_harmless(model):
    state = make_state(model)
    deep = b'{"model": "' + NAME.encode() + b'", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    marker = "\x00kvsieve-question\x00"
    with running(state) as url:
        nested = httpx.post(url + "/v1/chat/completions", content=deep, headers={"content-type": "application/json"})
        c = client(url)
        injected = c.chat.completions.create(model=NAME, max_tokens=2,
                                             messages=[{"role": "user", "content": DOC + marker + "\nq" + marker}])
        plain = c.chat.completions.create(model=NAME, max_tokens=2,
                                          messages=[{"role": "user", "content": DOC + "\nq"}])
        health = httpx.get(url + "/health")
    assert nested.status_code == 400 and nested.json()["error"]["message"] == (
        "the request body nests 100001 levels of arrays and objects; at most 16 are allowed")
    # the client's marker text is ordinary content: the prompt splits at its last newline as always
    assert injected.usage.prompt_tokens == plain.usage.prompt_tokens + 2 * len(marker)
    assert injected.usage.kv_cache["context_tokens"] == plain.usage.kv_cache["context_tokens"] + len(marker)
    assert health.status_code == 200


LONG = DOC * 2 + DOC[:100]  # 400 characters: four prompts of it hold more than 1e6 bytes of KV


def test_metrics_are_exact_integers_and_count_every_answered_status(model):
    state = make_state(model)
    with running(state) as url:
        c = client(url)
        for _ in range(4):
            c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": LONG + "\nq"}],
                                      max_tokens=2)
        httpx.post(url + "/v1/chat/completions", content=b"{bad")
        httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "a\nb", "max_tokenz": 1})
        httpx.get(url + "/v2/none")
        text = httpx.get(url + "/metrics").text
    full = 4 * BYTES_PER_TOKEN * (len("\x02user\x03") + len(LONG) + 1)
    assert full > 1_000_000 and f"kvsieve_kv_bytes_full_total {full}\n" in text  # :g would print 1.xxxxxe+06
    for line in ('kvsieve_requests_total{endpoint="chat",kv_cache="none",status="400"} 1',
                 'kvsieve_requests_total{endpoint="completion",kv_cache="none",status="422"} 1',
                 'kvsieve_requests_total{endpoint="other",kv_cache="none",status="404"} 1'):
        assert line in text, line
    assert "e+" not in text


def test_the_server_refuses_a_budget_it_cannot_read():
    from kvsieve.serve.command import parse_budget, total_memory

    assert parse_budget("2GiB") == 2 << 30 and parse_budget("512MiB") == 512 << 20 and parse_budget(4096) == 4096
    assert parse_budget("195035136B") == 195035136 and parse_budget("186MiB") == 186 * 2**20 == 195035136
    assert parse_budget("1.5 KiB") == 1536
    assert 0 < parse_budget("10%", tiny_model("llama")) < parse_budget("20%", tiny_model("llama")) * 0.6
    for bad in ("lots", "0B", "150%", "-1GiB"):
        with pytest.raises(ValueError, match=f"--kv-budget '{bad}'"):
            parse_budget(bad, tiny_model("llama"))
    # the bytes /health reports, given back without a unit, were read as GiB (186 EiB) and accepted
    with pytest.raises(ValueError, match=r"--kv-budget '195035136' has no unit: give bytes with a unit "
                                         r"\(195035136B, 512KiB, 186MiB, 2GiB, 1TiB\)"):
        parse_budget("195035136")
    for bad in ("inf", "nan", "-inf", "infGiB", "1e999MiB"):  # inf printed a traceback
        with pytest.raises(ValueError, match=f"--kv-budget '{bad}' is not a finite number"):
            parse_budget(bad)
    memory = total_memory()
    too_much = f"{memory + 1}B"
    with pytest.raises(ValueError, match=f"--kv-budget '{too_much}' is {memory + 1} bytes, more than this machine's "
                                         f"memory \\({memory} bytes"):
        parse_budget(too_much)
    with pytest.raises(ValueError, match="more than this machine's memory"):
        parse_budget(memory + 1)


def test_a_request_larger_than_the_whole_budget_is_refused_with_both_figures(model):
    state = make_state(model, kv_budget=BYTES_PER_TOKEN * 100)
    with running(state) as url, pytest.raises(openai.BadRequestError) as refused:
        client(url).chat.completions.create(model=NAME, messages=[{"role": "user", "content": DOC + "\nq"}],
                                            max_tokens=4)
    message = refused.value.body["message"]
    assert refused.value.body["code"] == "kv_budget_exceeded"
    assert f"the server's --kv-budget is {BYTES_PER_TOKEN * 100} bytes" in message


def test_kvzip_points_are_charged_twice_their_prefill(model):
    state = make_state(model, point_source(NAME, policy="kvzip", ratio=0.5))
    from kvsieve.serve.chat_prompt import completion_prompt
    from kvsieve.serve.points import ChosenPoint

    prompt = completion_prompt(ChatTokenizer(), DOC + "\nq")
    need, reserve = state.scheduler.need_of(prompt, state.points.base(None, 100), 4)
    plain, _ = state.scheduler.need_of(prompt, ChosenPoint(state.points.base(None, 100).point.full("-", ""), "full"),
                                       4)
    tokens = prompt.context_ids.shape[1] + prompt.question_ids.shape[1]
    assert reserve == 4 * BYTES_PER_TOKEN and plain == (tokens + 4) * BYTES_PER_TOKEN
    assert need == (2 * tokens + 4) * BYTES_PER_TOKEN


@pytest.mark.model
def test_the_shipped_surrogate_best_serves_on_smollm2_under_a_contract(smollm2, tmp_path):
    from kvsieve.serve.command import build_state

    program = Path(__file__).parents[2] / "results" / "evolve" / "smollm2-surrogate-best.py"
    spec = f"program:{program}"
    contract = ContractFile(Contract(), "smollm2-135m-instruct", "none", [], {"all": _cert(Point(spec, 0.75))})
    path = contract.write(tmp_path / "contract.json")
    model, tokenizer = smollm2
    state = build_state(model, tokenizer, "smollm2-135m-instruct", point_source("smollm2-135m", contract=str(path)),
                        max_tokens_limit=64, kv_budget="1GiB")
    # long enough that a quarter of it holds more than the program's 64-entry window
    context = ("Notes from the archive. " * 30 + "The special magic number for the blue door is 7423. "
               + "The records continue without change. " * 30)
    question = "What is the special magic number for the blue door?"
    with running(state) as url:
        reply = client(url).chat.completions.create(model="smollm2-135m-instruct", max_tokens=24,
                                                    messages=[{"role": "user", "content": context + "\n" + question}])
    kv = reply.usage.kv_cache
    assert (kv["policy"], kv["ratio"], kv["status"]) == (spec, 0.75, "certified"), kv["reason"]
    assert kv["kept_fraction"] < 0.4
    policy = parse(spec).build()
    policy.check_model(model, "smollm2-135m-instruct")  # binds the shipped SmolLM2 surrogate
    want = generate(model, tokenizer, context, question, policy, ratio=0.75, max_new_tokens=24)
    assert reply.choices[0].message.content == want.text and "7423" in want.text


def test_the_command_refuses_a_bad_budget_before_loading_a_model(capsys, monkeypatch):
    from kvsieve.serve import command

    monkeypatch.setattr(command, "load", lambda *_a: pytest.fail("the model was loaded"))
    assert command.main(["--kv-budget", "lots"]) == 2
    assert "--kv-budget 'lots' is not a budget" in capsys.readouterr().err
