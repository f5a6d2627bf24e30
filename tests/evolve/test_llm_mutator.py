"""LLM mutators: prompt, reply parsing, the OpenAI-compatible client against a local fake server, and
the in-process sampler on a tiny random model (no network, no real LLM)."""

from __future__ import annotations

import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from kvsieve.evolve.mutators.local_model import LocalLLMMutator, _SeededSampler
from kvsieve.evolve.mutators.openai_compatible import OpenAIMutator
from kvsieve.evolve.mutators.prompting import apply_search_replace, build_messages, extract_program, interface_doc
from kvsieve.language import operations
from kvsieve.language import program_features as feats
from kvsieve.language.program_source import SELECTION_RANGES, Program

PARENT = Program('"""Window attention."""\nSELECTION = {"chunk_size": 1, "sink": 0}\n\n\ndef score(f):\n'
                 '    a = group_mean(f.attn)\n    return pool(a, 5)\n')
CHILD = '"""Max over heads."""\n\n\ndef score(f):\n    return max_pool(group_max(f.attn), 7)\n'
INSPIRATION = Program("def score(f):\n    return f.value_norm\n")


def completion(content) -> bytes:
    return json.dumps({"id": "x", "object": "chat.completion",
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}).encode()


# --- fake OpenAI-compatible server --------------------------------------------------------------------


class FakeServer:
    """Records each request; answers with ``status``/``body`` (set per test), after ``delay`` seconds."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.status, self.body, self.delay = 200, completion(""), 0.0
        state = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's naming
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                state.requests.append({"path": self.path, "headers": dict(self.headers), "body": json.loads(raw)})
                time.sleep(state.delay)
                try:
                    self.send_response(state.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(state.body)))
                    self.end_headers()
                    self.wfile.write(state.body)
                except OSError:  # the client gave up (timeout test)
                    pass

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def reply(self, content=None, status: int = 200, body: bytes | None = None) -> None:
        self.status, self.body = status, body if body is not None else completion(content)


@pytest.fixture(scope="module")
def _server():
    server = FakeServer()
    server.thread.start()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


@pytest.fixture
def server(_server, monkeypatch):
    _server.requests.clear()
    _server.reply("")
    _server.delay = 0.0
    monkeypatch.delenv("KVSIEVE_TEST_KEY", raising=False)
    return _server


def client(server, **kwargs) -> OpenAIMutator:
    return OpenAIMutator(server.url, "tiny-coder", api_key_env="KVSIEVE_TEST_KEY", **kwargs)


def test_block_reply_becomes_the_child(server):
    server.reply(f"Here is a better one:\n```python\n{CHILD}```\nIt uses the max.")
    mutator = client(server)
    child = mutator.propose(PARENT, [INSPIRATION], random.Random(0))
    assert child == Program(CHILD)
    assert (mutator.proposed, mutator.malformed, mutator.failed, mutator.unchanged) == (1, 0, 0, 0)
    server.reply(f"```python\n{PARENT.source}\n\n# same program\n```")
    assert mutator.propose(PARENT, [], random.Random(0)) is not None and mutator.unchanged == 1
    request = server.requests[0]
    assert request["path"] == "/v1/chat/completions"
    body = request["body"]
    assert body["model"] == "tiny-coder" and body["temperature"] == 0.8 and body["max_tokens"] == 1024
    assert isinstance(body["seed"], int) and 0 <= body["seed"] < 2**31
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert body["messages"] == build_messages(PARENT, [INSPIRATION], None, [None], "block")


def test_seed_follows_the_rng(server):
    mutator = client(server)
    for _ in range(2):
        mutator.propose(PARENT, [], random.Random(5))
    mutator.propose(PARENT, [], random.Random(6))
    seeds = [r["body"]["seed"] for r in server.requests]
    assert seeds[0] == seeds[1] != seeds[2]


def test_diff_reply_is_applied_to_the_parent(server):
    server.reply("```\n<<<<<<< SEARCH\n    return pool(a, 5)\n=======\n    return pool(a, 9) + 0.1 * f.position\n"
                 ">>>>>>> REPLACE\n```")
    mutator = client(server, edit_format="diff")
    child = mutator.propose(PARENT, [], random.Random(0))
    assert child is not None
    assert child.source == PARENT.source.replace("pool(a, 5)", "pool(a, 9) + 0.1 * f.position")
    assert "SEARCH/REPLACE" in server.requests[-1]["body"]["messages"][1]["content"]


@pytest.mark.parametrize("edit_format,content", [
    ("block", "I would use the maximum over heads instead."),  # no fence
    ("block", "```python\ndef score(f):\n    return f.attn"),  # cut off: unclosed fence
    ("diff", "<<<<<<< SEARCH\n    return nothing_like_this\n=======\n    return f.position\n>>>>>>> REPLACE"),
    ("diff", "```python\ndef score(f):\n    return f.position\n```"),  # a block where edits were asked
    ("block", ""),
])
def test_malformed_replies_are_counted(server, edit_format, content):
    server.reply(content)
    mutator = client(server, edit_format=edit_format)
    assert mutator.propose(PARENT, [], random.Random(0)) is None
    assert (mutator.proposed, mutator.malformed, mutator.failed) == (1, 1, 0)
    assert mutator.last_reply == content


@pytest.mark.parametrize("status,body,needle", [
    (200, b"<html>not json</html>", "not JSON"),
    (200, json.dumps({"choices": []}).encode(), "choices[0]"),
    (200, json.dumps({"error": "overloaded"}).encode(), "choices[0]"),
    (200, completion(None), "NoneType"),
    (500, b'{"error": "boom"}', "HTTP 500"),
    (429, b"slow down", "HTTP 429"),
])
def test_transport_failures_are_counted(server, status, body, needle):
    server.reply(status=status, body=body)
    mutator = client(server)
    assert mutator.propose(PARENT, [], random.Random(0)) is None
    assert (mutator.proposed, mutator.malformed, mutator.failed) == (1, 0, 1)
    assert needle in mutator.last_error


def test_timeout_and_refused_connection_are_counted(server):
    server.delay = 1.0
    mutator = client(server, timeout_s=0.2)
    assert mutator.propose(PARENT, [], random.Random(0)) is None
    assert mutator.failed == 1 and "timed out" in mutator.last_error.lower()
    closed = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = closed.server_address[1]
    closed.server_close()
    refused = OpenAIMutator(f"http://127.0.0.1:{port}", "m", timeout_s=2)
    assert refused.propose(PARENT, [], random.Random(0)) is None
    assert refused.failed == 1 and refused.last_error


def test_api_key_is_read_from_the_env_at_call_time(server, monkeypatch):
    mutator = client(server)
    mutator.propose(PARENT, [], random.Random(0))
    assert "Authorization" not in server.requests[-1]["headers"]
    monkeypatch.setenv("KVSIEVE_TEST_KEY", "sk-secret-123")
    mutator.propose(PARENT, [], random.Random(0))
    assert server.requests[-1]["headers"]["Authorization"] == "Bearer sk-secret-123"
    assert "sk-secret" not in repr(mutator) and "sk-secret" not in str(vars(mutator))


def test_error_messages_redact_the_key(server, monkeypatch):
    monkeypatch.setenv("KVSIEVE_TEST_KEY", "sk-secret-123")
    server.reply(status=401, body=b'{"error": "invalid key sk-secret-123"}')
    mutator = client(server)
    assert mutator.propose(PARENT, [], random.Random(0)) is None
    assert "HTTP 401" in mutator.last_error and "sk-secret" not in mutator.last_error
    assert "***" in mutator.last_error


def test_prompt_holds_the_parent_the_interface_and_the_scores(server):
    scores = {PARENT.code_hash: 61.25, INSPIRATION.code_hash: 40.0}
    mutator = client(server, score_of=lambda p: scores.get(p.code_hash))
    mutator.propose(PARENT, [INSPIRATION], random.Random(0))
    system, user = (m["content"] for m in server.requests[-1]["body"]["messages"])
    assert interface_doc() in system
    assert PARENT.source.rstrip() in user and INSPIRATION.source.rstrip() in user
    assert "61.25" in user and "(score 40)" in user


@pytest.mark.parametrize("kwargs,message", [
    (dict(edit_format="patch"), "'patch'"),
    (dict(base_url=""), "base_url"),
    (dict(base_url="localhost:8000"), "http://"),
    (dict(model=" "), "model"),
    (dict(timeout_s=0), "timeout_s"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-1), "temperature"),
])
def test_bad_arguments_are_rejected_clearly(kwargs, message):
    args = dict(base_url="http://localhost:8000/v1", model="m") | kwargs
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as err:
        OpenAIMutator(**args)
    if "edit_format" in kwargs:
        assert "block" in str(err.value) and "diff" in str(err.value)


# --- prompt -------------------------------------------------------------------------------------------


def test_interface_doc_lists_the_whole_interface():
    doc = interface_doc()
    for name in (*operations.FUNCTIONS, *SELECTION_RANGES):
        assert name in doc, name
    for name in (*feats.TENSOR_FIELDS, *feats.SCALAR_FIELDS):
        assert f"f.{name}" in doc, name
    assert "(b, h, g, n)" in doc and "(b, h, n)" in doc
    for rule in ("no loops", "imports", "higher = keep"):
        assert rule in doc


def test_messages_ask_for_the_edit_format():
    block = build_messages(PARENT, [], 1.0, [], "block")[1]["content"]
    diff = build_messages(PARENT, [INSPIRATION], None, [2.5], "diff")[1]["content"]
    assert "```python" in block and "SEARCH" not in block
    for marker in ("<<<<<<< SEARCH", "=======", ">>>>>>> REPLACE"):
        assert marker in diff
    assert "not measured yet" in diff and "(score 2.5)" in diff
    with pytest.raises(ValueError, match="'unified'.*block"):
        build_messages(PARENT, [], None, [], "unified")
    with pytest.raises(ValueError, match="inspiration scores"):
        build_messages(PARENT, [INSPIRATION], None, [], "block")


# --- reply parsing ------------------------------------------------------------------------------------


@pytest.mark.parametrize("reply,expected", [
    ("```python\nx = 1\n```", "x = 1\n"),
    ("```\nx = 1\n```", "x = 1\n"),  # untagged
    ("```text\nnotes\n```\n```py\nx = 2\n```", "x = 2\n"),  # python beats an earlier untagged/other block
    ("```python\nx = 1\n```\n```python\nx = 2\n```", "x = 1\n"),  # the first python block
    ("1. Change:\n   ```python\n   def score(f):\n       return f.n\n   ```", "def score(f):\n    return f.n\n"),
    ("<think>```python\ndraft = 0\n```</think>\n```python\nfinal = 1\n```", "final = 1\n"),
    ("```Python   \nx = 1\n```   \ntrailing text", "x = 1\n"),
    ("no code here", None),
    ("", None),
    ("```python\nx = 1\n", None),  # unclosed
    ("```python\n\n```", None),  # empty
])
def test_extract_program(reply, expected):
    assert extract_program(reply) == expected


SOURCE = "def score(f):\n    a = group_mean(f.attn)\n    b = f.key_norm\n    return a + b\n"


@pytest.mark.parametrize("reply,expected", [
    ("<<<<<<< SEARCH\n    b = f.key_norm\n=======\n    b = f.value_norm\n>>>>>>> REPLACE",
     SOURCE.replace("key_norm", "value_norm")),
    ("<<<<<<< SEARCH\n    b = f.key_norm\n=======\n    b = f.value_norm\n>>>>>>> REPLACE\nand\n"
     "<<<<<<< SEARCH\n    return a + b\n=======\n    return a * b\n>>>>>>> REPLACE",
     SOURCE.replace("key_norm", "value_norm").replace("a + b", "a * b")),
    ("<<<<<<< SEARCH\n    b = f.key_norm\n    return a + b\n=======\n    return a\n>>>>>>> REPLACE",
     "def score(f):\n    a = group_mean(f.attn)\n    return a\n"),
    ("<<<<<<< SEARCH\n    b = f.key_norm\n=======\n>>>>>>> REPLACE",  # deletion
     "def score(f):\n    a = group_mean(f.attn)\n    return a + b\n"),
    ("<<<<<<< SEARCH\n    b = f.key_norm   \n=======\n    b = 1.0\n>>>>>>> REPLACE",  # trailing blanks
     SOURCE.replace("f.key_norm", "1.0")),
    ("<<<<<<< SEARCH\n    b = f.key\n=======\n    b = 1.0\n>>>>>>> REPLACE", None),  # partial line
    ("<<<<<<< SEARCH\n    c = 3\n=======\n    c = 4\n>>>>>>> REPLACE", None),  # not found
    ("<<<<<<< SEARCH\n=======\n    c = 4\n>>>>>>> REPLACE", None),  # empty search
    ("<<<<<<< SEARCH\n    b = f.key_norm\n=======\n    b = 1.0\n", None),  # unterminated
    ("<<<<<<< SEARCH\n    b = f.key_norm\n>>>>>>> REPLACE", None),  # no divider
    ("<<<<<<< SEARCH\n    b = f.key_norm\n=======\n    b = 1.0\n>>>>>>> REPLACE\n"  # second edit fails: all or none
     "<<<<<<< SEARCH\n    missing\n=======\n    x\n>>>>>>> REPLACE", None),
    ("```python\ndef score(f):\n    return 0\n```", None),  # no edit blocks
])
def test_apply_search_replace(reply, expected):
    assert apply_search_replace(SOURCE, reply) == expected


def test_search_that_matches_twice_is_rejected():
    source = "def score(f):\n    x = f.n\n    x = f.n\n    return x\n"
    assert apply_search_replace(source, "<<<<<<< SEARCH\n    x = f.n\n=======\n    y = 1\n>>>>>>> REPLACE") is None
    edit = "<<<<<<< SEARCH\n    x = f.n\n    return x\n=======\n    return 2 * x\n>>>>>>> REPLACE"
    assert apply_search_replace(source, edit) == "def score(f):\n    x = f.n\n    return 2 * x\n"


# --- local model --------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: a second OpenMP thread only waits (and spins on a shared machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer():
    """The bundled SmolLM2's tokenizer: its converted copy if present, else read from its GGUF file."""
    from transformers import AutoTokenizer

    from kvsieve.models import bundled, cache_dir, resolve_gguf

    folder = cache_dir() / bundled("smollm2-135m").folder_name / "hf"
    if (folder / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(folder))
    try:
        gguf = resolve_gguf(bundled("smollm2-135m"))
    except (FileNotFoundError, ValueError) as err:
        pytest.skip(f"bundled SmolLM2 is not installed: {err}")
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture(scope="module")
def tiny_lm(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, max_position_embeddings=4096,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(config).eval()


def test_local_gibberish_is_malformed_and_runs_are_reproducible(tiny_lm, tokenizer):
    replies = []
    global_rng = torch.get_rng_state()
    for seed in (3, 3, 4):
        mutator = LocalLLMMutator(tiny_lm, tokenizer, max_new_tokens=24)
        assert mutator.propose(PARENT, [INSPIRATION], random.Random(seed)) is None
        assert (mutator.proposed, mutator.malformed) == (1, 1) and mutator.seconds > 0
        replies.append(mutator.last_reply)
    assert replies[0] == replies[1] != replies[2]
    assert torch.equal(torch.get_rng_state(), global_rng)  # sampling used its own generator


class StubLM:
    """A "model" whose generate appends the tokens of a fixed reply, recording what it was given."""

    device = torch.device("cpu")

    def __init__(self, reply_ids: torch.Tensor) -> None:
        self.reply_ids, self.calls = reply_ids, []

    def generate(self, input_ids, **kwargs):
        self.calls.append((input_ids, kwargs))
        return torch.cat([input_ids, self.reply_ids[None]], dim=1)


def test_local_stub_reply_becomes_the_child(tokenizer):
    reply = f"Sure.\n```python\n{CHILD}```"
    stub = StubLM(tokenizer(reply, return_tensors="pt", add_special_tokens=False)["input_ids"][0])
    mutator = LocalLLMMutator(stub, tokenizer, max_new_tokens=77, temperature=0.5)
    child = mutator.propose(PARENT, [INSPIRATION], random.Random(0))
    assert child == Program(CHILD)
    assert (mutator.proposed, mutator.malformed) == (1, 0)
    input_ids, kwargs = stub.calls[0]
    prompt = tokenizer.decode(input_ids[0])
    assert prompt.startswith("<|im_start|>system") and prompt.rstrip().endswith("assistant")  # chat template
    assert PARENT.source.rstrip() in prompt and "SEARCH" not in prompt  # always the block format
    assert kwargs["max_new_tokens"] == 77 and kwargs["do_sample"] is False


def test_local_model_is_loaded_lazily(tokenizer, monkeypatch):
    import kvsieve.evolve.mutators.local_model as local_model

    stub = StubLM(tokenizer("```python\nx = 1\n```", return_tensors="pt")["input_ids"][0])
    calls = []
    monkeypatch.setattr(local_model, "load", lambda name, dtype: calls.append((name, dtype)) or (stub, tokenizer))
    mutator = LocalLLMMutator(dtype="float32")
    assert calls == []
    assert mutator.propose(PARENT, [], random.Random(0)) == Program("x = 1\n")
    mutator.propose(PARENT, [], random.Random(1))
    assert calls == [("qwen2.5-coder-0.5b-instruct", "float32")]
    with pytest.raises(ValueError, match="both"):
        LocalLLMMutator(model=stub)
    with pytest.raises(ValueError, match="top_p"):
        LocalLLMMutator(top_p=0)


def test_seeded_sampler_keeps_only_the_sampled_token():
    scores = torch.tensor([[0.0, 5.0, 1.0, 4.9], [3.0, 0.0, 0.0, 0.0]])
    greedy = _SeededSampler(torch.Generator().manual_seed(0), temperature=0.0, top_p=1.0)(None, scores)
    assert greedy.argmax(-1).tolist() == [1, 0] and torch.isinf(greedy).sum() == 6
    narrow = _SeededSampler(torch.Generator().manual_seed(0), temperature=1.0, top_p=1e-6)
    for _ in range(20):
        assert narrow(None, scores).argmax(-1).tolist() == [1, 0]
    wide = _SeededSampler(torch.Generator().manual_seed(0), temperature=1.0, top_p=0.9)
    picked = {wide(None, scores)[0].argmax().item() for _ in range(200)}
    assert picked == {1, 3}  # the top-p nucleus of row 0: tokens 1 and 3 hold over 90% of the mass
