"""A ``--policy`` point with recall through the real HTTP API (the official ``openai`` client): the answer is
``generate``'s with the same recall, and the reply, the headers and ``/metrics`` count the cold tier and the bytes the
question moved (tiny random llama, char tokenizer; see test_serve.py)."""

from __future__ import annotations

import httpx2 as httpx
import pytest
from conftest import tiny_model
from test_serve import DOC, NAME, ChatTokenizer, client, make_state, running

from kvsieve.engine.generate import generate
from kvsieve.policies import get
from kvsieve.recall import Recall
from kvsieve.serve.command import point_source

RECALL = "recall(fraction=0.1, chunk=8, pool='span')"


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


def test_a_recalling_point_answers_as_generate_does_and_counts_its_tiers(model):
    points = point_source(NAME, policy="knorm", ratio=0.75, recall=RECALL)
    assert points.evict_every == 0  # a recalling point answers from its recalled copy as it is
    state = make_state(model, points)
    question = "which letter?"
    with running(state) as url:
        raw = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": NAME, "messages": [{"role": "user", "content": DOC + "\n" + question}], "max_tokens": 8})
        reply = client(url).chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": DOC + "\n" + question}], max_tokens=8)
        metrics = httpx.get(url + "/metrics", timeout=10).text
    kv = reply.usage.kv_cache
    alone = generate(model, ChatTokenizer(), DOC, question, get("knorm"), ratio=0.75, max_new_tokens=8,
                     recall=Recall.parse(RECALL))
    assert reply.choices[0].message.content == alone.text
    assert kv["recall"] == RECALL and kv["bytes_cold"] == alone.cold_bytes > 0
    assert kv["bytes_moved"] == alone.moved_bytes > 0 and kv["bytes_kept"] == alone.cache_bytes_kept
    assert raw.headers["x-kvsieve-bytes-moved"] == str(alone.moved_bytes)
    assert f"kvsieve_kv_bytes_moved_total {2 * alone.moved_bytes}" in metrics


def test_recall_without_a_policy_or_beyond_the_ratio_is_refused():
    with pytest.raises(ValueError, match="--recall go with --policy"):
        point_source(NAME, recall="0.1")
    with pytest.raises(ValueError, match=r"recall fraction 0.3 is outside \[0, 0.25\)"):
        point_source(NAME, policy="knorm", ratio=0.75, recall="0.3")
