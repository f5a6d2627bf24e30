"""What ``kvsieve serve --replicas`` routes on, without Ray: a request's document key (``serve/routing.py``), the
replica rendezvous hashing gives it, and one request run through an ASGI app in-process (``serve/asgi_call.py``)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from kvsieve.serve import asgi_call
from kvsieve.serve.asgi_call import Head, HttpRequest
from kvsieve.serve.routing import MIN_DOCUMENT_CHARS, context_key, document_of, rank

CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
DOC = "The special magic number for the blue door is 7423. " + "Nothing else happened that day. " * 10


def chat(*messages: tuple[str, str], **fields) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": r, "content": c} for r, c in messages], **fields}).encode()


def test_one_document_has_one_key_whatever_the_question_or_the_turn():
    first = context_key(CHAT, chat(("user", DOC + "\nWhat is the number?")))
    assert first is not None and len(first) == 64
    assert context_key(CHAT, chat(("user", DOC + "\nWhich door?"), max_tokens=3, stream=True)) == first
    # the conversation's next turn: its context begins with the first turn's
    later = chat(("user", DOC + "\nWhat is the number?"), ("assistant", "7423"), ("user", "And the red door?"))
    assert context_key(CHAT, later) == first
    # content as text parts is the same text
    parts = json.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": DOC}, {"type": "text", "text": "\nWhich door?"}]}]}).encode()
    assert context_key(CHAT, parts) == first
    assert context_key(CHAT, chat(("user", DOC.replace("7423", "7424") + "\nWhat is the number?"))) != first


def test_a_system_document_keys_every_question_about_it():
    key = context_key(CHAT, chat(("system", DOC), ("user", "What is the number?")))
    assert key is not None
    assert context_key(CHAT, chat(("system", DOC), ("user", "Which door?"), ("assistant", "blue"),
                                  ("user", "Sure?"))) == key
    assert document_of(CHAT, chat(("system", DOC), ("user", "What is the number?"))) == [("system", DOC), ("user", "")]


def test_a_completion_prompt_keys_on_its_text_before_the_last_newline():
    key = context_key(COMPLETION, json.dumps({"model": "m", "prompt": DOC + "\nQ: the number?"}).encode())
    assert key is not None
    assert context_key(COMPLETION, json.dumps({"model": "m", "prompt": [DOC + "\nQ: which door?"]}).encode()) == key


def test_no_key_without_a_document_worth_a_replica():
    short = "x" * (MIN_DOCUMENT_CHARS - 2)
    assert context_key(CHAT, chat(("user", short + "\nq"))) is None  # 255 characters
    assert context_key(CHAT, chat(("user", short + "x\nq"))) is not None  # 256
    assert context_key(CHAT, chat(("user", DOC))) is None  # no newline: all of it is the question
    assert context_key(CHAT, chat(("system", DOC))) is None  # no user turn: the replica answers 400
    assert context_key(CHAT, b"{not json") is None
    assert context_key(CHAT, chat(("user", DOC + "\nq"), temperature="hot")) is None  # invalid: the replica says so
    assert context_key("/v1/models", b"") is None
    assert context_key(COMPLETION, json.dumps({"model": "m", "prompt": ["a", "b"]}).encode()) is None


def test_rendezvous_ranks_move_only_the_keys_of_a_replica_that_goes():
    keys = [f"{i:064x}" for i in range(600)]
    three = ["aaaa", "bbbb", "cccc"]
    first = {k: rank(k, three)[0] for k in keys}
    assert all(rank(k, list(reversed(three)))[0] == first[k] for k in keys)  # the order given does not matter
    assert all(sorted(rank(k, three)) == three for k in keys[:5])
    counts = [list(first.values()).count(r) for r in three]
    assert all(150 < c < 250 for c in counts), counts  # about a third each
    two = [r for r in three if r != "cccc"]
    for k in keys:
        now = rank(k, two)[0]
        assert now == first[k] if first[k] != "cccc" else now == rank(k, three)[1]  # only cccc's keys move, in rank


def _app(events: list[str], release: asyncio.Event) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"got": (await request.body()).decode(), "query": request.url.query}

    @app.get("/stream")
    async def stream(request: Request) -> StreamingResponse:
        async def chunks():
            yield b"first "
            await release.wait()  # the caller gets the first chunk before the second is written
            try:
                for i in range(100):
                    yield f"{i} ".encode()
                    await asyncio.sleep(0.01)
                events.append("all sent")
            finally:  # starlette cancels a stream whose client sent http.disconnect
                events.append("stopped")
        return StreamingResponse(chunks(), media_type="text/plain")

    return app


def test_a_request_runs_through_the_app_and_its_answer_streams_back():
    async def scenario():
        events, release = [], asyncio.Event()
        app = _app(events, release)
        parts = [p async for p in asgi_call.call(app, HttpRequest("POST", "/echo", b"a=1", [
            (b"content-type", b"application/json")], b"hello"), [(b"x-extra", b"1")])]
        head, body = parts[0], b"".join(parts[1:])
        assert isinstance(head, Head) and head.status == 200 and (b"x-extra", b"1") in head.headers
        assert json.loads(body) == {"got": "hello", "query": "a=1"}

        stream = asgi_call.call(app, HttpRequest("GET", "/stream", b"", [], b""))
        assert (await asyncio.wait_for(stream.__anext__(), 10)).status == 200
        assert await asyncio.wait_for(stream.__anext__(), 10) == b"first "  # not held until the app ends
        release.set()
        assert await asyncio.wait_for(stream.__anext__(), 10) == b"0 "
        await stream.aclose()  # the client left: the app sees http.disconnect and stops
        for _ in range(200):
            if events:
                break
            await asyncio.sleep(0.01)
        assert events == ["stopped"]

        missing = [p async for p in asgi_call.call(app, HttpRequest("GET", "/nowhere", b"", [], b""))]
        assert missing[0].status == 404

    asyncio.run(scenario())


def test_one_server_never_imports_ray():
    """Ray is optional: ``kvsieve serve`` without --replicas (its flags, the server, the routing) imports none of it."""
    code = ("import sys, kvsieve.cli_arguments, kvsieve.serve.command, kvsieve.serve.routing, kvsieve.serve.asgi_call; "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
