"""CertifiedPolicy and contract files: the model check, malformed points, question-awareness, length buckets."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from conftest import CharTokenizer, tiny_model

from kvsieve.engine.generate import generate
from kvsieve.harness.store import CellKey, CellResult, ResultsStore
from kvsieve.policies import get
from kvsieve.policies.label import Point
from kvsieve.prompt import build_prompt
from kvsieve.risk import Certification, CertifiedPolicy, Contract, ContractFile, certify_buckets, loss_table
from kvsieve.risk.contract import request_context_tokens


def _contract(chosen: Point | None, model: str = "smollm2-135m-instruct", by: str = "none",
              edges: list[int] | None = None, buckets: tuple[str, ...] = ("all",)) -> ContractFile:
    cert = Certification(0.1, 0.1, 0.0, "binary", "bonferroni", 60, [], chosen, "" if chosen else "none certified")
    return ContractFile(Contract(), model, by, edges or [], {b: cert for b in buckets})


def test_contract_for_another_model_is_refused(tmp_path):
    path = _contract(Point("knorm", 0.5)).write(tmp_path / "c.json")
    with pytest.raises(ValueError, match="certified for model 'smollm2-135m-instruct', not 'qwen2.5-0.5b'"):
        CertifiedPolicy.from_contract(path, model="qwen2.5-0.5b")
    with pytest.raises(ValueError, match="not 'qwen2.5-coder-0.5b-instruct'"):
        CertifiedPolicy(ContractFile.read(path), model="qwen2.5-coder-0.5b-instruct")
    # the alias names the same model
    assert CertifiedPolicy.from_contract(path, model="smollm2-135m").operating_point().point.ratio == 0.5


@pytest.mark.parametrize("field, value, message", [
    ("ratio", 1.5, r"ratio 1\.5; a compression ratio is in \[0, 1\)"),
    ("ratio", -0.25, r"ratio -0\.25"),
    ("ratio", "half", r"ratio 'half'"),
    ("question_aware", "yes", r"question_aware 'yes'"),
    ("policy", "snapkv(window=", r"policy 'snapkv\(window='"),
])
def test_contract_with_an_impossible_point_does_not_load(tmp_path, field, value, message):
    path = _contract(Point("knorm", 0.5)).write(tmp_path / "c.json")
    data = json.loads(path.read_text())
    data["buckets"]["all"]["chosen"][field] = value
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message) as err:
        ContractFile.read(path)
    assert str(path) in str(err.value) and "chosen point" in str(err.value)


def test_contract_with_bad_bucketing_does_not_load(tmp_path):
    path = _contract(Point("knorm", 0.5)).write(tmp_path / "c.json")
    data = json.loads(path.read_text())
    for key, value, message in (("by", "model", "by='model' is not one of none, task, task_family, length"),
                                ("length_edges", [4096, 2048], "length_edges must be increasing"),
                                ("length_quantity", "chars", "length_quantity='chars'")):
        bad = dict(data, **{key: value})
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            ContractFile.read(path)
    del data["buckets"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="lacks buckets"):
        ContractFile.read(path)


def test_certified_attach_honours_question_awareness():
    model, tok = tiny_model("llama"), CharTokenizer()
    prompt = build_prompt(tok, "k" * 150, "which key?")
    n, m, ratio = prompt.context_ids.shape[1], prompt.question_ids.shape[1], 0.5
    ids = torch.cat([prompt.context_ids, prompt.question_ids], dim=1)
    certified = CertifiedPolicy(_contract(Point("knorm", ratio, question_aware=True)))
    with torch.no_grad(), certified.attach(model, question_tokens=m) as run:
        assert run.prefill_question
        model(input_ids=ids, use_cache=True)
        kept = run.session.kept_tokens
        positions = run.session.cache.layers[0].positions
    # budget on the context part, the question kept on top (derived by hand, not from the engine)
    assert kept == [round(n * (1 - ratio)) + m] * 3
    assert set(range(n, n + m)) <= set(positions[0, 0].tolist())
    # a query-agnostic point compresses the context alone and asks for it first
    agnostic = CertifiedPolicy(_contract(Point("knorm", ratio)))
    with torch.no_grad(), agnostic.attach(model, question_tokens=m) as run:
        assert not run.prefill_question
        model(input_ids=prompt.context_ids, use_cache=True)
        assert run.session.kept_tokens == [round(n * (1 - ratio))] * 3


def test_certified_generate_equals_the_engine_at_the_question_aware_point():
    model, tok = tiny_model("llama"), CharTokenizer()
    certified = CertifiedPolicy(_contract(Point("knorm", 0.5, question_aware=True)))
    got = certified.generate(model, tok, "k" * 150, "which key?", max_new_tokens=4)
    want = generate(model, tok, "k" * 150, "which key?", get("knorm"), ratio=0.5, question_aware=True, max_new_tokens=4)
    agnostic = generate(model, tok, "k" * 150, "which key?", get("knorm"), ratio=0.5, max_new_tokens=4)
    assert got.token_ids == want.token_ids and got.kept_tokens == want.kept_tokens
    assert got.kept_tokens != agnostic.kept_tokens  # the question is in the cache only question-aware


def test_a_decode_time_point_runs_with_the_chunk_and_eviction_interval_it_was_certified_at():
    """``knorm@decode16`` is stored by a grid that read the context in chunks of 16 and evicted after every generated
    token (the label's interval, 1 unless it says ``eN``; harness/evaluate passes it to the engine), so the runtime
    runs it so, not at the engine's default interval (32)."""
    model, tok = tiny_model("llama"), CharTokenizer()
    for label, every in (("knorm@decode16", 1), ("knorm@decode16e4", 4)):
        certified = CertifiedPolicy(_contract(Point.parse(label, 0.5)))
        with torch.no_grad(), certified.attach(model, question_tokens=3) as run:
            assert not run.prefill_question
            assert (run.session.mode, run.session.chunk_size, run.session.evict_every) == ("decode", 16, every)
        got = certified.generate(model, tok, "k" * 150, "which key?", max_new_tokens=6)
        want = generate(model, tok, "k" * 150, "which key?", get("knorm"), ratio=0.5, mode="decode", chunk_size=16,
                        evict_every=every, max_new_tokens=6)
        assert got.token_ids == want.token_ids and got.kept_tokens == want.kept_tokens


def test_a_point_certified_at_ratio_0_runs_as_full_kv_not_as_a_fallback():
    """Ratio 0 evicts nothing: the request runs full KV, which is what the contract chose (not a fallback)."""
    chosen = CertifiedPolicy(_contract(Point("knorm", 0.0))).operating_point()
    assert chosen.point.is_full and not chosen.point.compresses and chosen.policy.name == "full"
    assert not chosen.fell_back and "evicts nothing" in chosen.reason


def _row(sample: int, policy: str, ratio: float, score: float, context_tokens: int) -> CellResult:
    key = CellKey("m", "niah_single_1", 1024, str(sample), policy, ratio, False)
    return CellResult(key, "", score, ["x"], 10, 500 if ratio else 1000, 1000, 0.1, 0.1,
                      {"context_tokens": context_tokens})


def test_length_buckets_count_context_tokens_at_both_ends(tmp_path):
    # every request is nominally 1024 long but holds 990 context tokens; the edge sits between the two
    rows = [r for i in range(30) for r in (_row(i, "full", 0.0, 100.0, 990), _row(i, "knorm", 0.5, 100.0, 990))]
    with ResultsStore(tmp_path / "r.sqlite") as store:
        store.add_many(rows)
        table = loss_table(store, "m", [Point("knorm", 0.5)])
        tokens = request_context_tokens(store, "m", table.requests)
    assert set(tokens.values()) == {990}
    out = certify_buckets(table, Contract(alpha=0.1, delta=0.1), "m", by="length", length_edges=[1000],
                          context_tokens=tokens)
    assert list(out.buckets) == ["<=1000"] and out.length_quantity == "context_tokens"
    path = out.write(tmp_path / "c.json")
    certified = CertifiedPolicy.from_contract(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same quantity: nothing to warn about
        point = certified.operating_point(context_tokens=990)  # the calibration requests route to their bucket
    assert (point.bucket, point.fell_back, point.point.ratio) == ("<=1000", False, 0.5)
    # without the token counts the buckets are nominal, the contract says so and routing warns
    nominal = certify_buckets(table, Contract(alpha=0.1, delta=0.1), "m", by="length", length_edges=[1000])
    assert list(nominal.buckets) == [">1000"] and nominal.length_quantity == "nominal"
    with pytest.warns(UserWarning, match="nominal length"):
        assert CertifiedPolicy(nominal).operating_point(context_tokens=990).fell_back


def test_request_context_tokens_names_rows_without_them(tmp_path):
    with ResultsStore(tmp_path / "r.sqlite") as store:
        row = _row(0, "full", 0.0, 100.0, 990)
        store.add_many([CellResult(row.key, "", 100.0, ["x"], 10, 1000, 1000, 0.1, 0.1, {})])
        with pytest.raises(ValueError, match="do not record context_tokens"):
            request_context_tokens(store, "m", [("niah_single_1", 1024, "0")])


def test_old_contract_files_read_as_nominal(tmp_path):
    path = _contract(Point("knorm", 0.5), by="length", edges=[1000], buckets=("<=1000",)).write(tmp_path / "c.json")
    data = json.loads(path.read_text())
    del data["length_quantity"]
    path.write_text(json.dumps(data))
    assert ContractFile.read(path).length_quantity == "nominal"
    assert np.isclose(ContractFile.read(path).buckets["<=1000"].chosen.ratio, 0.5)
