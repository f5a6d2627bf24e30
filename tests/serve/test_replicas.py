"""``kvsieve serve --replicas``: two replicas of the bundled SmolLM2 on a local Ray instance, called through the real
HTTP API with the official openai client. One document's requests reach one replica (the one its key ranks first), both
replicas answer, a conversation's later turns follow its first, streams and errors pass through as one server writes
them, and random routing spreads one document over both.

One Ray instance (2 CPUs: one per replica) serves the module: ``kvsieve serve --replicas 2`` runs as a command that
joins it, and a second application at ``/random`` is a random-routing ingress over the same two replicas.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import openai
import pytest

serve = pytest.importorskip("ray.serve")
import ray  # noqa: E402

from kvsieve.cli import main as cli_main  # noqa: E402
from kvsieve.serve import replicas  # noqa: E402
from kvsieve.serve.routing import context_key, rank  # noqa: E402

pytestmark = pytest.mark.ray

MODEL = "smollm2-135m-instruct"
QUESTION = "What is the special magic number for the {color} door?"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def document(i: int) -> str:
    """A document of about 400 characters (over the routing minimum), distinct for each ``i``."""
    return (f"Report {i}. The special magic number for the blue door is {7000 + i}. "
            f"The special magic number for the red door is {8000 + i}. " + "Nothing else happened that day. " * 9)


def messages(i: int, color: str = "blue") -> list[dict]:
    return [{"role": "user", "content": document(i) + "\n" + QUESTION.format(color=color)}]


def key_of(msgs: list[dict]) -> str:
    return context_key("/v1/chat/completions", json.dumps({"model": MODEL, "messages": msgs}).encode())


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The real command, ``kvsieve serve --replicas 2``, joining a local Ray instance this process started (as on a
    cluster: ``--ray-address``); then a random-routing ingress over its replicas at ``/random``. SIGTERM ends it."""
    port = _free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    log = tmp_path_factory.mktemp("replicas") / "serve.log"
    command = [sys.executable, "-c", "import sys; from kvsieve.cli import main; sys.exit(main())", "serve",
               "--model", MODEL, "--replicas", "2", "--dtype", "float32", "--kv-budget", "256MiB", "--port",
               str(port), "--drain-timeout", "5", "--ray-address", ray.get_runtime_context().gcs_address]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while "replicas on Ray" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        assert f"2 replicas on Ray (1 thread each, context routing), http://127.0.0.1:{port}/v1" in log.read_text()
        handle = serve.get_deployment_handle("replica", replicas.APP)
        spread = serve.deployment(replicas.Ingress, name="ingress").options(ray_actor_options={"num_cpus": 0})
        serve.run(spread.bind(handle, "random", 4 << 20), name="random", route_prefix="/random")
        yield f"http://127.0.0.1:{port}"
        serve.delete("random")
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, log.read_text()[-3000:]
        assert replicas.APP not in serve.status().applications  # the command deleted its application
    finally:
        if process.poll() is None:
            process.kill()
        serve.shutdown()
        ray.shutdown()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(url: str, msgs: list[dict], **kw):
    """(the answer, the replica that wrote it, the key the ingress routed on)."""
    raw = client(url).chat.completions.with_raw_response.create(model=MODEL, messages=msgs, max_tokens=4, **kw)
    return raw.parse(), raw.headers.get("x-kvsieve-replica"), raw.headers.get("x-kvsieve-context-key")


def test_one_document_reaches_one_replica_and_both_replicas_answer(base):
    seen: dict[int, str] = {}  # document -> replica
    for i in range(40):  # until both replicas answered: each new document reaches the other with probability 1/2
        reply, replica, key = ask(base, messages(i))
        assert reply.choices[0].message.content and replica
        assert key == key_of(messages(i))[:16]
        seen[i] = replica
        if len(set(seen.values())) == 2 and len(seen) >= 3:
            break
    names = sorted(set(seen.values()))
    assert len(names) == 2, f"one replica answered {len(seen)} documents: {seen}"
    for i, replica in seen.items():
        assert rank(key_of(messages(i)), names)[0] == replica  # the key's replica, as the router ranks it
        # another question about the same document, and the conversation's next turn, reach the same replica
        assert ask(base, messages(i, "red"))[1] == replica
        turns = messages(i) + [{"role": "assistant", "content": "7000"},
                               {"role": "user", "content": QUESTION.format(color="red")}]
        assert ask(base, turns)[1] == replica


def test_a_stream_comes_through_its_replica_chunk_by_chunk(base):
    _, replica, _ = ask(base, messages(0))
    raw = client(base).chat.completions.with_raw_response.create(
        model=MODEL, messages=messages(0), max_tokens=8, stream=True, stream_options={"include_usage": True})
    assert raw.headers["x-kvsieve-replica"] == replica
    chunks = list(raw.parse())
    assert len(chunks) > 2 and "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 8


def test_errors_are_the_replicas_own(base):
    with pytest.raises(openai.BadRequestError, match="temperature 0.7 is not supported") as err:
        client(base).chat.completions.create(model=MODEL, messages=messages(1), max_tokens=4, temperature=0.7)
    assert err.value.response.headers.get("x-kvsieve-replica")
    with pytest.raises(openai.APIStatusError, match="this server accepts at most") as err:
        client(base).chat.completions.create(model=MODEL, max_tokens=4,
                                             messages=[{"role": "user", "content": "x" * (5 << 20) + "\nq"}])
    assert err.value.status_code == 413


def test_random_routing_spreads_one_document_over_both_replicas(base):
    seen = []
    for _ in range(16):  # both replicas but with probability 2 / 2**16 = 3e-5
        reply, replica, key = ask(base + "/random", messages(2))
        assert reply.choices[0].message.content and key is None
        seen.append(replica)
    assert len(set(seen)) == 2, seen


def test_the_command_checks_its_flags_before_ray_starts(capsys):
    assert cli_main(["serve", "--replicas", "2", "--ratio", "0.5"]) == 2
    assert "--ratio, --question-aware and --recall go with --policy" in capsys.readouterr().err
    assert cli_main(["serve", "--replicas", "-1"]) == 2
    assert "--replicas -1: give a positive number of replicas" in capsys.readouterr().err


def test_the_router_sends_a_key_to_its_replica_only_and_draws_one_without_a_key():
    fake = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=name)) for name in ("aaaa", "bbbb", "cccc")]

    def choose(route) -> str:
        pending = SimpleNamespace(kwargs={"route": route})
        ranks = asyncio.run(replicas.ContextRouter.choose_replicas(None, fake, pending))
        assert len(ranks) == 1 and len(ranks[0]) == 1  # no fallback: Ray waits for this one
        return ranks[0][0].replica_id.unique_id

    keys = [f"{i:064x}" for i in range(8)]
    assert [choose(k) for k in keys] == [rank(k, ["aaaa", "bbbb", "cccc"])[0] for k in keys]
    assert len({choose(None) for _ in range(60)}) == 3  # uniform: all three with probability 1 - 3 (2/3)**60
    assert asyncio.run(replicas.ContextRouter.choose_replicas(None, [], None)) == []
