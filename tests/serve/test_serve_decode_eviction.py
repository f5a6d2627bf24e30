"""A decode-time point served (serve/decode_prefill.py, serve/decode_eviction.py): the prompt read under eviction and
each row evicted every ``E`` generated tokens exactly as ``kvsieve eval --mode decode`` ran it (the same entries kept,
the same text), held at its cap (its per-layer budgets plus ``E`` entries a head) and charged exactly that from its
join on, so more rows run under one byte budget; a row's text does not depend on what else runs; a contract's
decode-time point evicts as a ``--policy`` one does; and a policy that fails is answered at full KV with the reason
(tiny random llama, char tokenizer; see test_serve.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import pytest
import torch
from conftest import random_kvzap, tiny_model
from test_serve import BYTES_PER_TOKEN, NAME, ChatTokenizer, _cert, client, hook, make_state, running

from kvsieve.engine.attach import attach
from kvsieve.engine.cache import SieveLayer, cache_allocated_bytes, clone_cache, sieve_layers
from kvsieve.engine.compress import compress_cache
from kvsieve.engine.generate import generate
from kvsieve.policies import parse
from kvsieve.policies.label import Point
from kvsieve.policies.operating_point import OperatingPoint
from kvsieve.policy import FullCache, Policy
from kvsieve.prompt import build_prompt
from kvsieve.risk import CertifiedPolicy, Contract, ContractFile
from kvsieve.selection import Budget
from kvsieve.serve.command import point_source
from kvsieve.serve.decode_eviction import evict_rows, hold_room, row_cap, stack_rows
from kvsieve.serve.decode_prefill import DecodePrefill
from kvsieve.serve.points import ChosenPoint
from kvsieve.serve.scheduler import Job

EVERY = 4  # generated tokens between a row's evictions: the room its segments keep
CHUNK = 32  # prompt tokens read between evictions
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


class _Prunes:
    """The positions every prune leaves, in order: what a path kept, entry for entry."""

    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []
        self._original = SieveLayer.prune

    def __enter__(self) -> _Prunes:
        log, original = self, self._original

        def prune(layer, *args, **kwargs):
            original(layer, *args, **kwargs)
            log.kept.append(layer.positions.clone())

        SieveLayer.prune = prune
        return self

    def __exit__(self, *exc) -> None:
        SieveLayer.prune = self._original


def served_alone(model, prompt, chosen: ChosenPoint, max_tokens: int, step_tokens: int = 50):
    """One request at ``chosen`` run as the scheduler runs it, alone in its batch: its prefill advanced
    ``step_tokens`` at a time, then decode steps under the engine's attention, evicted when its room is used up."""
    prefill = DecodePrefill(model, prompt, chosen, max_tokens)
    while not prefill.done:
        prefill.advance(step_tokens)
    cache, logits, info = prefill.finished()
    policy = chosen.point.policy
    cap = row_cap(cache, policy, prefill.room) if prefill.evicts_while_decoding else None
    batch, position, fed, tokens, logits = stack_rows(None, cache), info.prompt_tokens, 0, [], logits[None]
    while True:
        tokens.append(int(logits.argmax(-1)))
        if len(tokens) == max_tokens:
            return tokens, info
        if cap is not None and fed >= cap.room:
            batch, _, failed = evict_rows(batch, [(policy, cap)], [position], [fed])
            assert not failed, failed
            fed = 0
        with torch.no_grad(), attach(model, FullCache()):
            logits = model(input_ids=torch.tensor([tokens[-1:]]), cache=batch, use_cache=True,
                           position_ids=torch.tensor([[position]])).logits[:, -1]
        position, fed = position + 1, fed + 1


LABELS = ["knorm@decode32e4", "tova@decode16e8", "snapkv(window=8)@decode32e5", "streaming_llm@decode24e3",
          "adakv(window=8)@decode32e4", "pyramidkv(window=8)@decode32e6", "knorm@decode32"]


@pytest.mark.parametrize("label", LABELS)
def test_a_decode_time_point_keeps_and_answers_what_eval_stored(model, label):
    """The grid's decode mode (``generate(mode="decode")``, what ``kvsieve eval --mode decode`` stores) and the server's
    decode-time prefill and batch evictions keep the same entries at every prune, in the same order, and generate the
    same tokens; the prefill read a step of 50 tokens at a time over chunks of 16-32. (The grid also evicts after
    its last forward when the count falls due there; the server evicts before a step that would take one more.)"""
    point = Point(label, 0.5)
    policy = point.policy_spec.build()
    doc = _doc(1, 300)
    with _Prunes() as grid:
        want = generate(model, ChatTokenizer(), doc, "next?", policy, ratio=0.5, max_new_tokens=MAX_TOKENS,
                        **point.engine_options)
    chosen = ChosenPoint(OperatingPoint(point, policy), "uncertified")
    with _Prunes() as served:
        tokens, info = served_alone(model, build_prompt(ChatTokenizer(), doc, "next?"), chosen, MAX_TOKENS)
    assert tokens == want.token_ids
    layers = len(model.model.layers)
    assert len(served.kept) > layers * ((MAX_TOKENS - 2) // point.evict_every)  # the prompt's and generated tokens'
    assert len(grid.kept) - len(served.kept) in (0, layers)
    assert all(torch.equal(a, b) for a, b in zip(grid.kept, served.kept))
    assert (info.kept_tokens, info.bytes_kept, info.bytes_full) == (want.kept_tokens, want.cache_bytes_kept,
                                                                    want.cache_bytes_full)


def test_a_served_decode_time_point_answers_as_generate_and_names_its_mode(model):
    """Through the server: ``--policy knorm --evict-every 4`` is the point ``knorm@decode4e4``, and a label carries its
    own (``knorm@decode32e4``); each answers generate's decode-mode text, evicts while it decodes, and names the point
    in usage, the headers and /metrics. A decode-time point of a policy the batch cannot evict (h2o reads accumulated
    attention) and one also given a different --evict-every are refused at start."""
    doc = _doc(2, 200)
    for spec, every, label in (("knorm", EVERY, "knorm@decode4e4"), ("knorm@decode32e4", 0, "knorm@decode32e4"),
                               ("knorm@decode32e4", 4, "knorm@decode32e4")):
        state = make_state(model, point_source(NAME, policy=spec, ratio=0.5, evict_every=every), max_queue=8)
        with running(state) as url:
            raw = client(url).chat.completions.with_raw_response.create(
                model=NAME, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": doc + "\nnext?"}])
            metrics = httpx.get(url + "/metrics").text
        reply, kv = raw.parse(), raw.parse().usage.kv_cache
        point = state.points.fixed.point
        want = generate(model, ChatTokenizer(), doc, "next?", state.points.fixed.policy, ratio=0.5,
                        max_new_tokens=MAX_TOKENS, **point.engine_options)
        assert point.stored == label and reply.choices[0].message.content == want.text
        assert state.scheduler.evictions >= MAX_TOKENS // EVERY - 1
        assert (kv["point"], kv["evict_every"], kv["policy"]) == (f"{label}@0.5", EVERY, "knorm")
        assert (raw.headers["x-kvsieve-point"], raw.headers["x-kvsieve-evict-every"]) == (f"{label}@0.5", "4")
        assert f'kvsieve_point_requests_total{{kv_cache="uncertified",point="{label}"}} 1' in metrics
    with pytest.raises(ValueError, match="evicts while it decodes, but its policy reads what the server's decode"):
        point_source(NAME, policy="h2o@decode32e4", ratio=0.5)
    with pytest.raises(ValueError, match="evicts every 4 generated tokens, and --evict-every 8 was given too"):
        point_source(NAME, policy="knorm@decode32e4", ratio=0.5, evict_every=8)
    with pytest.raises(ValueError, match="does not evict while it decodes"):
        point_source(NAME, policy="knorm", ratio=0.5, evict_every=8, recall="0.1")
    assert point_source(NAME, policy="knorm", ratio=0.5).fixed.point.stored == "knorm"  # a prefill point as given


def test_a_contracts_decode_time_point_evicts_while_it_decodes(model, tmp_path):
    """A contract certifying ``knorm@decode32e4`` for a length bucket: the server runs it as certified, reading the
    prompt under eviction and evicting the row every 4 tokens (status certified), generate's text; a client naming the
    point by its label may ask for a stricter ratio of it, still decoding under eviction."""
    buckets = {"<=64": _cert(None, "no candidate certified: falling back to full KV"),
               "<=1000": _cert(Point("knorm@decode32e4", 0.5))}
    path = ContractFile(Contract(), NAME, "length", [64, 1000], buckets).write(tmp_path / "c.json")
    points = point_source(NAME, contract=str(path))
    assert set(points.known) == {"knorm@decode32e4"}
    state = make_state(model, points, max_queue=8)
    doc = _doc(3, 220)
    with running(state) as url:
        c = client(url)
        ask = [{"role": "user", "content": doc + "\nnext?"}]
        reply = c.chat.completions.create(model=NAME, max_tokens=MAX_TOKENS, messages=ask)
        evicted = state.scheduler.evictions
        stricter = c.chat.completions.create(model=NAME, max_tokens=MAX_TOKENS, messages=ask,
                                             extra_body={"kvsieve": {"policy": "knorm@decode32e4", "ratio": 0.25}})
    kv = reply.usage.kv_cache
    assert (kv["status"], kv["point"], kv["evict_every"]) == ("certified", "knorm@decode32e4@0.5", 4)
    assert evicted >= MAX_TOKENS // EVERY - 1 and state.scheduler.evictions >= 2 * evicted
    policy = CertifiedPolicy(ContractFile.read(path), NAME).policies["knorm"]
    want = generate(model, ChatTokenizer(), doc, "next?", policy, ratio=0.5, max_new_tokens=MAX_TOKENS,
                    mode="decode", chunk_size=32, evict_every=4)
    assert reply.choices[0].message.content == want.text
    assert (stricter.usage.kv_cache["status"], stricter.usage.kv_cache["point"]) == ("stricter",
                                                                                     "knorm@decode32e4@0.25")


def test_rows_evicting_while_they_decode_are_charged_their_cap_and_more_of_them_run(model):
    """knorm@decode32e4 at 0.5: a row is held at the budget of its context, half of it, plus 4 entries of room a head
    (the question is read inside the budget), so its charge from its join on is b x (round(n / 2) + 4) (b: one token's
    bytes in every layer), against b x (n + m + 30) it was admitted for. A budget of one admission plus two caps then
    runs three rows at once; the sum of charges never passes it, and the batch never allocates more than its rows are
    charged (the step raises otherwise, failing the requests)."""
    doc = _doc(1, 180)
    n, m = _sizes(doc)
    need = BYTES_PER_TOKEN * (n + m + MAX_TOKENS)
    cap = BYTES_PER_TOKEN * (Budget(0.5).resolve(n) + EVERY)  # independent of the code: the model's sizes
    budget = need + 2 * cap
    state = make_state(model, point_source(NAME, policy="knorm@decode32e4", ratio=0.5), max_queue=8,
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
    assert scheduler.peak_rows == 3  # without decode-time eviction, a row holds b x (round(n / 2) + m + 30)
    assert BYTES_PER_TOKEN * (round(n * 0.5) + m + MAX_TOKENS) * 3 > budget - need + cap
    assert scheduler.charged == 0


@pytest.mark.parametrize("allocation", ["uniform", "global"])
def test_kvzap_evicts_while_decoding_from_its_remembered_scores(model, tmp_path, allocation):
    """kvzap scores an entry from its own key and value, which a cache pruned per head no longer aligns across heads:
    each eviction keeps its scores with the entries and scores only the tokens taken since. Its rows run to
    max_tokens, each at most its cap, and answer what generate answers in decode mode."""
    path = random_kvzap(model, tmp_path / "z.safetensors", name=NAME)
    spec = f"kvzap(checkpoint='{path}', allocation='{allocation}')@decode32e4"
    state = make_state(model, point_source(NAME, policy=spec, ratio=0.5), max_queue=8)
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
    fixed = state.points.fixed
    want = generate(model, ChatTokenizer(), _doc(0, 150), "q?", fixed.policy, ratio=0.5, max_new_tokens=MAX_TOKENS,
                    **fixed.point.engine_options)
    assert replies[0].choices[0].message.content == want.text


def test_an_eviction_keeps_each_row_as_it_would_alone(model):
    """Two rows in one batch take three tokens, then the second is evicted: its entries are those compress_cache
    keeps of it decoded alone (the positions it took in the batch, numbered by the first row's count, rewritten to
    its own), the first row is left as it was."""
    spec = parse("knorm")
    chosen = ChosenPoint(OperatingPoint(Point(spec, 0.5, mode=Point("knorm@decode32e4").mode), spec.build()),
                         "uncertified")
    caches, positions = [], []
    for i in range(2):
        prompt = build_prompt(ChatTokenizer(), _doc(i, 120 + 30 * i), "next?")
        prefill = DecodePrefill(model, prompt, chosen, MAX_TOKENS)
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
    nan = ChosenPoint(OperatingPoint(Point("knorm", 0.5), NaNScores()), "uncertified")
    nan_decode = ChosenPoint(OperatingPoint(Point("knorm@decode32e4", 0.5), NaNScores()), "uncertified")
    full = ChosenPoint(OperatingPoint.full(fell_back=False), "full")
    with running(state):
        jobs = [state.scheduler.submit(Job(prompt, chosen, 8)) for chosen in (nan, nan_decode, full)]
        results = [job.future.result(timeout=60) for job in jobs]
    got, got_decode, want = results
    assert got.cache.chosen.status == "fallback" and "NaN" in got.cache.chosen.point.reason
    assert got.cache.chosen.point.reason.startswith("policy knorm@0.5 failed while compressing (ValueError")
    assert not got.cache.chosen.setting.compresses and got.token_ids == want.token_ids
    reason = got_decode.cache.chosen.point.reason
    assert reason.startswith("policy knorm@decode32e4@0.5 failed while reading the prompt under eviction (ValueError")
    assert got_decode.cache.chosen.status == "fallback" and got_decode.token_ids == want.token_ids
