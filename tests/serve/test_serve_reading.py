"""How kvsieve serve reads a request: a client that leaves mid-body, a body or a head that never finishes, and the
memory the JSON depth check takes (tiny random llama, char tokenizer; raw sockets against a live server)."""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
import socket
import time
import tracemalloc

import httpx2 as httpx
import pytest
from conftest import tiny_model
from test_serve import NAME, _wait, make_state, running
from test_serve_hostile import _nesting, _random_value

from kvsieve.serve import command
from kvsieve.serve.arguments import add_arguments
from kvsieve.serve.reading import DEFAULT_READ_TIMEOUT
from kvsieve.serve.schemas import MAX_JSON_DEPTH, ChatCompletionRequest, json_depth, parse_body
from kvsieve.serve.state import ServerState

HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n")


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server writes until it closes the connection."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_a_client_that_leaves_mid_body_is_counted_499_with_one_line_and_no_traceback(model):
    """starlette raises ClientDisconnect from the body read: it was counted as a 500 and logged ~64 lines of
    traceback ("Exception in ASGI application")."""
    state = make_state(model)
    logger = logging.getLogger("uvicorn.error")
    records, level = _Records(), logger.level
    with running(state) as url:
        logger.addHandler(records)
        logger.setLevel(logging.INFO)  # the one line is informational: show it here to count it
        try:
            with socket.create_connection(_address(url), timeout=10) as sock:
                sock.sendall(HEAD + b'{"model": "')  # 11 of the 1000 bytes it announced, then it leaves
                time.sleep(0.3)
            metrics: list[str] = []
            _wait(lambda: metrics.append(httpx.get(url + "/metrics").text) or 'status="499"' in metrics[-1])
        finally:
            logger.removeHandler(records)
            logger.setLevel(level)
    assert 'kvsieve_requests_total{endpoint="chat",kv_cache="none",status="499"} 1' in metrics[-1]
    assert 'status="500"' not in metrics[-1]
    assert not any(r.exc_info for r in records.records), [r.getMessage() for r in records.records]
    said = [r.getMessage() for r in records.records if "disconnect" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0] and "499" in said[0], said


def test_a_body_shorter_than_its_content_length_gets_408_after_the_read_timeout(model):
    """It waited forever: uvicorn bounds no body read."""
    state = make_state(model, read_timeout=1.0)
    with running(state) as url, socket.create_connection(_address(url), timeout=20) as sock:
        start = time.monotonic()
        sock.sendall(HEAD + b'{"model": "')
        reply = _read_all(sock)  # the 408, then the server closes the connection
        took = time.monotonic() - start
        metrics = httpx.get(url + "/metrics").text
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), reply
    assert 0.9 < took < 10, took
    error = json.loads(body)["error"]
    assert error["code"] == "read_timeout"
    assert error["message"] == ("the request body did not arrive within --read-timeout (1 s): 11 of the 1000 bytes "
                                "its Content-Length announced came")
    assert 'kvsieve_requests_total{endpoint="chat",kv_cache="none",status="408"} 1' in metrics


def test_a_head_sent_a_byte_at_a_time_gets_408_after_the_read_timeout(model):
    """A header sent one byte every few seconds was held open for as long as it went on (uvicorn's keep-alive
    timer starts after a first response, and each byte received cancels it)."""
    state = make_state(model, read_timeout=1.0)
    with running(state) as url, socket.create_connection(_address(url), timeout=20) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")
        reply = b""
        for byte in b"X-Slow: " + b"a" * 60:  # 0.2 s a byte: 13 s if nothing stops it
            try:
                sock.sendall(bytes([byte]))
            except OSError:  # the server closed the connection
                break
            time.sleep(0.2)
            if not reply:
                sock.setblocking(False)
                try:
                    reply = sock.recv(65536)
                except BlockingIOError:
                    pass
                sock.setblocking(True)
            if reply:
                break
        sock.settimeout(10)
        reply += _read_all(sock)
        took = time.monotonic() - start
    assert reply.startswith(b"HTTP/1.1 408 "), reply
    assert b"--read-timeout (1 s)" in reply
    assert took < 5, took


def test_an_idle_connection_that_sends_nothing_is_closed_after_the_read_timeout(model):
    state = make_state(model, read_timeout=1.0)
    with running(state) as url, socket.create_connection(_address(url), timeout=20) as sock:
        start = time.monotonic()
        reply = _read_all(sock)
        took = time.monotonic() - start
    assert reply == b"" and 0.9 < took < 5, (reply, took)


def test_a_slow_request_within_the_read_timeout_is_answered(model):
    """The deadline is on the head and the body, not a cut of a request that arrives in time, in pieces."""
    state = make_state(model, read_timeout=5.0)
    body = json.dumps({"model": NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "abc\nq"}]}).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    with running(state) as url, socket.create_connection(_address(url), timeout=30) as sock:
        for piece in (head[:20], head[20:], body[:10], body[10:]):
            sock.sendall(piece)
            time.sleep(0.3)
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 200 "), reply


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "30"])
def test_a_read_timeout_that_is_no_positive_number_of_seconds_is_refused(value):
    with pytest.raises(ValueError, match=re.escape(f"read_timeout must be a finite number of seconds > 0, got "
                                                   f"{value!r}")):
        ServerState(None, None, NAME, None, None, 100, read_timeout=value)


def _big_body(size: int) -> bytes:
    """A chat request of at least ``size`` bytes whose content is full of what the scanner must skip."""
    unit = 'a"[{\\ }] \u00e9 '
    content = unit * (size // (len(json.dumps(unit)) - 2) + 1)  # its escaped length, less the quotes
    return json.dumps({"model": NAME, "messages": [{"role": "user", "content": content}],
                       "kvsieve": {"a": [[[1]]]}}).encode()


def test_the_depth_check_of_a_4_mib_body_takes_under_3x_its_size():
    """It built about six int64 arrays the body's length: 176 MiB traced for one 4 MiB body."""
    raw = _big_body(4 << 20)
    assert len(raw) >= 4 << 20
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        depth = json_depth(raw)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert depth == _nesting(json.loads(raw)) == 5  # {"kvsieve": {"a": [[[1]]]}}
    assert peak < 3 * len(raw), f"{peak} bytes traced for a {len(raw)}-byte body"


@pytest.mark.parametrize("window", [1, 2, 3, 7, 64])
def test_the_depth_check_in_windows_counts_what_the_parser_nests(window):
    """Windows smaller than the bodies: every string, escape run and bracket crosses a boundary somewhere."""
    rng = random.Random(window)
    for _ in range(300):
        value = _random_value(rng)
        raw = json.dumps(value, ensure_ascii=rng.random() < 0.5).encode()
        assert json_depth(raw, window=window) == _nesting(value), raw
    runs = b'["' + b"\\" * 9 + b'"", "' + b"\\" * 10 + b'", [[]]]'  # odd and even backslash runs
    assert _nesting(json.loads(runs)) == 3 and json_depth(runs, window=window) == 3


def test_a_too_deep_body_is_refused_with_the_same_message():
    raw = b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1)
    with pytest.raises(Exception, match=re.escape(f"the request body nests {MAX_JSON_DEPTH + 1} levels of arrays "
                                                  f"and objects; at most {MAX_JSON_DEPTH} are allowed")):
        parse_body(raw, ChatCompletionRequest)


def test_the_read_timeout_flag_defaults_to_the_servers_and_is_checked_before_the_model_loads(capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).read_timeout == DEFAULT_READ_TIMEOUT == ServerState.read_timeout
    assert parser.parse_args(["--read-timeout", "2.5"]).read_timeout == 2.5
    assert command.main(["--read-timeout", "0"]) == 2  # returns before load(): no model is read
    assert "--read-timeout must be a finite number of seconds > 0, got 0.0" in capsys.readouterr().err
