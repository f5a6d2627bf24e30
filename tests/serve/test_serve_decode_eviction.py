"""A compressing row that also evicts while it decodes (serve/decode_eviction.py): held at its cap (its compressed
prompt plus ``evict_every`` entries a head), charged exactly that from its join on, so more rows run under one byte
budget; a row's text does not depend on what else runs; and a policy that scores NaN is answered at full KV with the
reason (tiny random llama, char tokenizer; see test_serve.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import random_kvzap, tiny_model
from test_serve import BYTES_PER_TOKEN, NAME, ChatTokenizer, client, hook, make_state, running

from kvsieve.engine.attach import attach
from kvsieve.engine.cache import cache_allocated_bytes, clone_cache, sieve_layers
from kvsieve.engine.compress import compress_cache
from kvsieve.policies import parse
from kvsieve.policies.label import Point
from kvsieve.policies.operating_point import OperatingPoint
from kvsieve.policy import FullCache, Policy
from kvsieve.prompt import build_prompt
from kvsieve.serve.command import point_source
from kvsieve.serve.decode_eviction import evict_rows, hold_room, row_cap, stack_rows
from kvsieve.serve.generation import Prefill
from kvsieve.serve.points import ChosenPoint
from kvsieve.serve.scheduler import Job

EVERY = 4  # decode steps between a row's evictions: the room its segments keep
MAX_TOKENS = 30


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


def _doc(i: int, length: int) -> str:
    return "".join(chr(97 + (j * (i + 5) + i) % 26) for j in range(length))


def _sizes(doc: str) -> tuple[int, int]:
    prompt = build_prompt(ChatTokenizer(), doc, "next?")
    return prompt.context_ids.shape[1], prompt.question_ids.shape[1]


class _Watch:
    """A forward pre-hook on every decode step: the scheduler's charges, each running row's charge and what the batch
    allocates, and each row's segment lengths after its eviction."""

    def __init__(self, state) -> None:
        self.state, self.steps = state, []

    def __call__(self, _m, _a, kwargs) -> None:
        if kwargs.get("position_ids") is None:
            return
        scheduler = self.state.scheduler
        rows = list(scheduler._rows)
        self.steps.append({"charged": scheduler.charged, "allocated": cache_allocated_bytes(kwargs["cache"]),
                           "rows": len(rows), "charges": [job.charge for job in rows],
                           "capped": [job.cap is not None for job in rows]})


def test_rows_evicting_while_they_decode_are_charged_their_cap_and_more_of_them_run(model):
    """knorm@0.5, query-agnostic, evicting every 4 tokens: a row holds half its context, its question and 4 entries of
    room a head, so its charge from its join on is b x (round(n / 2) + m + 4) (b: one token's bytes in every layer),
    against b x (n + m + 30) it was admitted for. A budget of one admission plus two caps then runs three rows at
    once; the sum of charges never passes it, and the batch never allocates more than its rows are charged (the step
    raises otherwise, failing the requests)."""
    doc = _doc(1, 180)
    n, m = _sizes(doc)
    need = BYTES_PER_TOKEN * (n + m + MAX_TOKENS)
    cap = BYTES_PER_TOKEN * (round(n * 0.5) + m + EVERY)  # independent of the code: the model's sizes
    budget = need + 2 * cap
    state = make_state(model, point_source(NAME, policy="knorm", ratio=0.5, evict_every=EVERY), max_queue=8,
                       kv_budget=budget)
    watch = _Watch(state)
    with hook(model, watch), running(state) as url:
        c = client(url)

        def ask(_i: int):
            return c.chat.completions.create(model=NAME, max_tokens=MAX_TOKENS,
                                             messages=[{"role": "user", "content": doc + "\nnext?"}])

        with ThreadPoolExecutor(5) as pool:
            replies = list(pool.map(ask, range(5)))
    scheduler = state.scheduler
    assert all(r.usage.completion_tokens == MAX_TOKENS for r in replies)
    assert len({r.choices[0].message.content for r in replies}) == 1  # one text, whatever ran beside it
    assert scheduler.evictions >= 5 * (MAX_TOKENS // EVERY - 1)
    assert {charge for step in watch.steps for charge in step["charges"]} == {cap}
    assert max(step["charged"] for step in watch.steps) <= budget and scheduler.peak_charged <= budget
    assert all(step["allocated"] <= sum(step["charges"]) for step in watch.steps)
    assert scheduler.peak_rows == 3  # prefill-only, each row would hold b x (round(n / 2) + m + 30): two at most
    assert BYTES_PER_TOKEN * (round(n * 0.5) + m + MAX_TOKENS) * 3 > budget - need + cap
    assert scheduler.charged == 0


@pytest.mark.parametrize("allocation", ["uniform", "global"])
def test_kvzap_evicts_while_decoding_from_its_remembered_scores(model, tmp_path, allocation):
    """kvzap scores an entry from its own key and value, which a cache pruned per head no longer aligns across heads:
    the prefill keeps its scores with the entries and each eviction scores only the tokens taken since. Its rows run
    to max_tokens, each at most its cap."""
    path = random_kvzap(model, tmp_path / "z.safetensors", name=NAME)
    spec = f"kvzap(checkpoint='{path}', allocation='{allocation}')"
    state = make_state(model, point_source(NAME, policy=spec, ratio=0.5, evict_every=EVERY), max_queue=8)
    watch = _Watch(state)
    with hook(model, watch), running(state) as url:
        c = client(url)

        def ask(i: int):
            return c.chat.completions.create(model=NAME, max_tokens=MAX_TOKENS,
                                             messages=[{"role": "user", "content": _doc(i, 150 + 10 * i) + "\nq?"}])

        with ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(ask, range(3)))
    assert all(r.usage.completion_tokens == MAX_TOKENS and r.usage.kv_cache["status"] == "uncertified"
               for r in replies)
    assert state.scheduler.evictions >= 3 * (MAX_TOKENS // EVERY - 1)
    assert all(all(step["capped"]) for step in watch.steps)
    assert all(step["allocated"] <= sum(step["charges"]) for step in watch.steps)


def test_an_eviction_keeps_each_row_as_it_would_alone(model):
    """Two rows in one batch take three tokens, then the second is evicted: its entries are those compress_cache
    keeps of it decoded alone (the positions it took in the batch, numbered by the first row's count, rewritten to
    its own), the first row is left as it was."""
    spec = parse("knorm")
    chosen = ChosenPoint(OperatingPoint(Point(spec, 0.5), spec.build()), "uncertified", EVERY)
    caches, positions = [], []
    for i in range(2):
        prompt = build_prompt(ChatTokenizer(), _doc(i, 120 + 30 * i), "next?")
        prefill = Prefill(model, prompt, chosen, MAX_TOKENS)
        while not prefill.done:
            prefill.advance(64)
        cache, _, info = prefill.finished()
        caches.append(cache)
        positions.append(info.prompt_tokens)
    cap = row_cap(caches[1], chosen.point.policy, EVERY)
    batch = stack_rows(stack_rows(None, caches[0]), caches[1])
    alone = clone_cache(caches[1])
    at = torch.tensor([[p] for p in positions])
    with torch.no_grad(), attach(model, FullCache()):  # three tokens each: the batch numbers them by one count
        for step in range(3):
            ids = torch.tensor([[5 + step], [9 + step]])
            model(input_ids=ids, cache=batch, use_cache=True, position_ids=at + step)
            model(input_ids=ids[1:], cache=alone, use_cache=True)
    positions = [p + 3 for p in positions]
    compress_cache(alone, chosen.point.policy, protected_tail=1, layer_budgets=cap.layer_budgets)
    hold_room(alone, EVERY)
    after, order, failed = evict_rows(batch, [None, (chosen.point.policy, cap)], positions, [3, 3])
    assert not failed and order == [0, 1]
    layers = zip(sieve_layers(after), sieve_layers(alone), sieve_layers(caches[0]))
    for (idx, got), (_, want), (_, other) in layers:
        lengths, rows = got.store.lengths.view(2, -1), got.padded()
        assert lengths[1].tolist() == want.store.lengths.tolist()
        assert lengths[0].tolist() == [n + 3 for n in other.store.lengths.tolist()]
        assert float(lengths[1].float().mean()) <= cap.layer_budgets[idx]  # back to its budget
        width = int(lengths[1].max())
        torch.testing.assert_close(rows["keys"][1, :, -width:], want.padded()["keys"][0], atol=1e-5, rtol=1e-4)
        assert torch.equal(rows["positions"][1, :, -width:], want.padded()["positions"][0])
    assert cache_allocated_bytes(alone) <= cap.charge


class NaNScores(Policy):
    """A policy whose scores are NaN: the engine refuses them (compress.checked_scores)."""

    name = "nan_scores"

    def score(self, signals):
        return torch.full((signals.batch_size, signals.num_kv_heads, signals.seq_len), float("nan"))


def test_a_policy_scoring_nan_is_answered_at_full_kv_with_the_reason(model):
    """The engine refuses NaN scores; the server answers that request at full KV, status fallback, naming why, and the
    text is full KV's."""
    state = make_state(model, point_source(NAME), max_queue=4)
    doc = _doc(4, 160)
    prompt = build_prompt(ChatTokenizer(), doc, "next?")
    nan = ChosenPoint(OperatingPoint(Point("knorm", 0.5), NaNScores()), "uncertified", EVERY)
    full = ChosenPoint(OperatingPoint.full(fell_back=False), "full")
    with running(state):
        jobs = [state.scheduler.submit(Job(prompt, chosen, 8)) for chosen in (nan, full)]
        results = [job.future.result(timeout=60) for job in jobs]
    got, want = results
    assert got.cache.chosen.status == "fallback" and "NaN" in got.cache.chosen.point.reason
    assert got.cache.chosen.point.reason.startswith("policy knorm@0.5 failed while compressing (ValueError")
    assert not got.cache.chosen.setting.compresses and got.token_ids == want.token_ids
