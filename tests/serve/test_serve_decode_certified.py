"""Decode-time points on SmolLM2, end to end: ``kvsieve eval`` and the server keep the same entries and answer the same
text for a point that evicts while it decodes, and ``kvsieve certify --run`` certifies such a point from a decode-mode
grid, whose contract the server then runs evicting every N generated tokens."""

from __future__ import annotations

import json

import pytest
import torch
from test_serve import client, running
from test_serve_decode_eviction import _Prunes

from kvsieve.engine.generate import generate
from kvsieve.harness.evaluate import evaluate_sample
from kvsieve.policies.label import Point
from kvsieve.prompt import build_prompt
from kvsieve.risk import CertifiedPolicy
from kvsieve.serve.command import build_state, point_source
from kvsieve.serve.scheduler import Job
from kvsieve.serve.schemas import KvsieveOptions
from kvsieve.tasks.sample import Sample

pytestmark = pytest.mark.model

NAME = "smollm2-135m-instruct"
MAX_NEW = 24
WORDS = "river garden teacher window mountain letter engine village market candle harbor forest".split()


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same float sums in the scheduler's thread and this one
    yield
    torch.set_num_threads(threads)


def _sample() -> Sample:
    text = " ".join(f"The {WORDS[i % 12]} near the {WORDS[(i * 5 + 3) % 12]} is quiet." for i in range(40))
    needle = "The special magic number for purple-lake is: 4819273."
    context = text[: len(text) // 2] + " " + needle + " " + text[len(text) // 2:]
    return Sample(id="0", task="pin", context=context, question="What is the special magic number for purple-lake?",
                  answer_prefix="", answers=["4819273"], max_new_tokens=MAX_NEW, length=0, seed=0,
                  metric="string_match_all")


@pytest.mark.parametrize("label", ["tova@decode64e8", "kvzap(checkpoint='smollm2-135m-instruct')@decode96e5"])
def test_eval_and_serve_keep_and_answer_alike_on_smollm2(smollm2, one_thread, label):
    """The same sample at a decode-time point through ``evaluate_sample`` (the grid's decode mode) and through the
    server's scheduler (its decode-time prefill, read 100 tokens a step, then its row evicted in the decode batch):
    every prune keeps the same positions in the same order, and the answers are one text."""
    model, tokenizer = smollm2
    sample, point = _sample(), Point(label, 0.5)
    with _Prunes() as grid:
        (row,) = evaluate_sample(model, tokenizer, sample, [point], NAME)
    assert not hasattr(row, "reason"), row
    state = build_state(model, tokenizer, NAME, point_source(NAME, policy=label, ratio=0.5), kv_budget="1GiB",
                        prefill_chunk=100)
    prompt = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
    try:
        with _Prunes() as served:
            job = state.scheduler.submit(Job(prompt, state.points.decide(KvsieveOptions(), prompt), MAX_NEW))
            done = job.future.result(timeout=600)
    finally:
        state.scheduler.close(60)
    assert done.cache.chosen.status == "uncertified" and done.cache.chosen.evict_every == point.evict_every
    assert state.scheduler.evictions >= 1 and done.text == row.prediction
    layers = len(model.model.layers)
    assert len(grid.kept) - len(served.kept) in (0, layers)  # the grid may also evict after its last forward
    assert len(served.kept) > layers and all(torch.equal(a, b) for a, b in zip(grid.kept, served.kept))
    assert (max(done.cache.kept_tokens), done.cache.bytes_kept) == (row.kept_tokens, row.cache_bytes)


def test_certify_run_certifies_a_decode_time_point_the_server_runs_while_decoding(smollm2, one_thread, tmp_path,
                                                                                   capsys):
    """``kvsieve certify --run`` with a decode-time label evaluates it (and full KV) in a decode-mode grid, and the
    contract's point carries the mode (chunk 64, eviction every 8 generated tokens). At alpha 0.9 and delta 0.5 two
    requests certify it with one of them wrong (tova at 0.25 answered both, and three of three, as full KV did, in
    float32 on AVX2): what is tested is the path, not a figure. The server started from that contract runs it as
    certified, evicting while it decodes, and answers generate's text."""
    from kvsieve.cli import main

    store, out = tmp_path / "cal.sqlite", tmp_path / "contract.json"
    assert main(["certify", "--run", "--store", str(store), "--model", NAME, "--policies", "tova@decode64e8",
                 "--ratios", "0.25", "--tasks", "niah_single_1", "--lengths", "512", "--samples", "2",
                 "--alpha", "0.9", "--delta", "0.5", "--out", str(out)]) == 0
    assert "-> tova@decode64e8@0.25 (decode-time eviction" in capsys.readouterr().out
    chosen = json.loads(out.read_text())["buckets"]["all"]["chosen"]
    certified = CertifiedPolicy.from_contract(out, NAME)
    point = certified.operating_point().point
    assert (point.stored, point.chunk_size, point.evict_every) == ("tova@decode64e8", 64, 8), chosen
    model, tokenizer = smollm2
    state = build_state(model, tokenizer, NAME, point_source(NAME, contract=str(out)), kv_budget="1GiB")
    context = _sample().context
    with running(state) as url:
        reply = client(url).chat.completions.create(
            model=NAME, max_tokens=MAX_NEW, messages=[{"role": "user", "content": context + "\nWhat is the special "
                                                                                   "magic number for purple-lake?"}])
    kv = reply.usage.kv_cache
    assert (kv["status"], kv["point"], kv["evict_every"]) == ("certified", "tova@decode64e8@0.25", 8)
    assert state.scheduler.evictions >= 1
    want = generate(model, tokenizer, context, "What is the special magic number for purple-lake?",
                    certified.policies["tova"], ratio=0.25, max_new_tokens=MAX_NEW, **point.engine_options)
    assert reply.choices[0].message.content == want.text
