"""Risk control: p-values, multiple testing, certification, contracts, runtime, validity."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvsieve.harness.store import CellKey, CellResult, ResultsStore
from kvsieve.policies import parse
from kvsieve.policies.label import Point
from kvsieve.risk import (
    CertifiedPolicy,
    Contract,
    ContractFile,
    InsufficientCalibrationError,
    LossTable,
    candidate_losses,
    certify,
    certify_buckets,
    empirical_threshold,
    loss_table,
)
from kvsieve.risk.losses import candidates_for
from kvsieve.risk.pvalues import (
    binomial_cdf,
    binomial_pvalue,
    clopper_pearson,
    hoeffding_bentkus_pvalue,
    min_calibration_size,
)
from kvsieve.risk.testing import chains_rejected, fixed_sequence
from kvsieve.risk.validity import split_validity


def _max_certifiable_failures(n: int, alpha: float, delta: float) -> int:
    return max((k for k in range(n + 1) if binomial_pvalue(k, n, alpha) <= delta), default=-1)


def test_exact_binomial_known_values():
    assert _max_certifiable_failures(100, 0.1, 0.1) == 5
    assert _max_certifiable_failures(500, 0.05, 0.05) == 16


def test_binomial_cdf_matches_direct_sum():
    n, p = 30, 0.2
    for k in (0, 3, 6, 29):
        direct = sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))
        assert binomial_cdf(k, n, p) == pytest.approx(direct, rel=1e-10)


def test_min_calibration_size_is_the_zero_failure_bound():
    assert min_calibration_size(0.1, 0.1) == 22
    assert min_calibration_size(0.05, 0.05) == 59
    for alpha, delta in ((0.1, 0.1), (0.05, 0.05), (0.2, 0.1)):
        n = min_calibration_size(alpha, delta)
        assert binomial_pvalue(0, n, alpha) <= delta < binomial_pvalue(0, n - 1, alpha)


@pytest.mark.parametrize("n", [22, 60, 200])
def test_hoeffding_bentkus_never_less_conservative_than_binomial(n):
    for alpha in (0.05, 0.1, 0.2):
        for k in range(n + 1):
            assert hoeffding_bentkus_pvalue(k / n, n, alpha) >= binomial_pvalue(k, n, alpha) - 1e-12


def _hb_by_hand(mean: float, n: int, alpha: float) -> float:
    """Bates et al. / Learn-then-Test's Hoeffding-Bentkus p-value, written out with exact binomial terms:
    min(exp(-n h1(min(mean, alpha), alpha)), e * P(Bin(n, alpha) <= ceil(n mean)))."""
    a = min(mean, alpha)
    h1 = a * math.log(a / alpha) + (1 - a) * math.log((1 - a) / (1 - alpha))
    tail = sum(math.comb(n, i) * alpha**i * (1 - alpha) ** (n - i) for i in range(math.ceil(round(n * mean, 9)) + 1))
    return min(1.0, math.exp(-n * h1), math.e * tail)


@pytest.mark.parametrize("mean,n,alpha,pinned", [(0.05, 60, 0.1, 0.3670), (0.025, 200, 0.1, 1.0523e-4)])
def test_hoeffding_bentkus_pinned_values(mean, n, alpha, pinned):
    # (0.05, 60): the Hoeffding term wins (0.36700; e * tail = 0.37349, the tail alone 0.13740);
    # (0.025, 200): the Bentkus term wins (e * 3.8712e-5; Hoeffding gives 1.7049e-4)
    assert _hb_by_hand(mean, n, alpha) == pytest.approx(pinned, rel=1e-4)
    assert hoeffding_bentkus_pvalue(mean, n, alpha) == pytest.approx(pinned, rel=1e-4)


def test_clopper_pearson_brackets_the_proportion():
    lo, hi = clopper_pearson(5, 100)
    assert lo == pytest.approx(0.0164, abs=1e-3) and hi == pytest.approx(0.1128, abs=1e-3)
    assert clopper_pearson(0, 50)[0] == 0.0 and clopper_pearson(50, 50)[1] == 1.0


def test_fixed_sequence_stops_at_first_failure():
    assert fixed_sequence([0.01, 0.02, 0.5, 0.001], 0.05) == 2
    assert fixed_sequence([0.5, 0.001], 0.05) == 0
    assert fixed_sequence([], 0.05) == 0


def test_holm_recycles_the_level_of_finished_chains():
    chains = [[0.01], [0.01, 0.07]]  # chain 0 fully rejected at 0.05 frees its share for chain 1
    assert chains_rejected(chains, 0.1, "bonferroni") == [1, 1]
    assert chains_rejected(chains, 0.1, "holm") == [1, 2]
    with pytest.raises(ValueError, match="split"):
        chains_rejected(chains, 0.1, "split")


@pytest.mark.parametrize("bad", [dict(alpha=0), dict(alpha=1.0), dict(delta=-0.1), dict(delta=1.5),
                                 dict(epsilon=-1), dict(loss="mse"), dict(correction="bh")])
def test_contract_rejects_bad_values(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name if name != "correction" else "bh"):
        Contract(**bad)


def _table(risks: dict[Point, float], n: int, rng: np.random.Generator) -> LossTable:
    losses = {c: (rng.random(n) < r).astype(float) for c, r in risks.items()}
    return LossTable([("t", 1, str(i)) for i in range(n)], losses, {c: c.retention for c in risks})


CHAIN = {Point("snapkv", 0.25): 0.0, Point("snapkv", 0.5): 0.02, Point("snapkv", 0.75): 0.3,
         Point("knorm", 0.25): 0.05, Point("knorm", 0.5): 0.12}


def test_certify_picks_least_cache_certified_point():
    table = _table(CHAIN, 400, np.random.default_rng(0))
    cert = certify(table, Contract(alpha=0.1, delta=0.1))
    assert cert.chosen == Point("snapkv", 0.5)
    by = {r.candidate: r for r in cert.candidates}
    assert not by[Point("snapkv", 0.75)].certified and by[Point("snapkv", 0.25)].certified
    assert by[Point("snapkv", 0.75)].empirical_risk > 0.2 and cert.n == 400 and not cert.fell_back


def test_fixed_sequence_within_a_compressor_blocks_later_points():
    # 0.5 fails, so 0.75 is never certified even though its losses are all zero
    losses = {Point("p", 0.25): np.zeros(100), Point("p", 0.5): np.ones(100),
              Point("p", 0.75): np.zeros(100)}
    table = LossTable([("t", 1, str(i)) for i in range(100)], losses)
    cert = certify(table, Contract(alpha=0.1, delta=0.1))
    assert cert.chosen == Point("p", 0.25)
    assert [r.certified for r in cert.candidates] == [True, False, False]


def test_falls_back_to_full_kv_when_nothing_certifies():
    table = _table({Point("snapkv", 0.5): 0.5, Point("knorm", 0.5): 0.4}, 100, np.random.default_rng(1))
    cert = certify(table, Contract(alpha=0.1, delta=0.1))
    assert cert.fell_back and cert.chosen is None and "full KV" in cert.reason
    assert empirical_threshold(table, 0.1) is None


def test_too_few_requests_is_refused_with_the_number():
    table = _table({Point("snapkv", 0.5): 0.0}, 21, np.random.default_rng(2))
    with pytest.raises(InsufficientCalibrationError, match="22"):
        certify(table, Contract(alpha=0.1, delta=0.1))
    table = _table({Point("snapkv", 0.5): 0.0}, 22, np.random.default_rng(2))
    assert certify(table, Contract(alpha=0.1, delta=0.1)).chosen == Point("snapkv", 0.5)


@pytest.mark.parametrize("n", [22, 43])
def test_too_few_requests_counts_every_compressor(n):
    # 10 compressors under Bonferroni: the first candidate of each is tested at delta / 10, so zero failures
    # need (1 - alpha)^n <= 0.01, n >= log(0.01) / log(0.9) = 43.7 -> 44
    zero = {Point(f"p{i}", 0.5): 0.0 for i in range(10)}
    with pytest.raises(InsufficientCalibrationError, match="44"):
        certify(_table(zero, n, np.random.default_rng(3)), Contract(alpha=0.1, delta=0.1))
    assert certify(_table(zero, 44, np.random.default_rng(3)), Contract(alpha=0.1, delta=0.1)).chosen is not None


@pytest.mark.parametrize("correction", ["bonferroni", "holm", "split"])
def test_violation_rate_is_at_most_delta_in_simulation(correction):
    # true risks are known; a violation is choosing a point whose true risk exceeds alpha
    alpha, delta, n, trials = 0.1, 0.1, 150, 300
    risks = {Point("a", 0.25): 0.04, Point("a", 0.5): 0.09, Point("a", 0.75): 0.13,
             Point("b", 0.5): 0.11, Point("b", 0.75): 0.2}
    rng = np.random.default_rng(3)
    contract = Contract(alpha=alpha, delta=delta, correction=correction)
    violations = empirical_violations = certified_any = 0
    for t in range(trials):
        table = _table(risks, n, rng)
        chosen = certify(table, contract, seed=t).chosen
        violations += chosen is not None and risks[chosen] > alpha
        certified_any += chosen is not None
        baseline = empirical_threshold(table, alpha)
        empirical_violations += baseline is not None and risks[baseline] > alpha
    lower = clopper_pearson(violations, trials)[0]  # the CI's lower end must not exceed delta
    assert lower <= delta, violations
    assert certified_any > trials // 2  # it is not vacuously valid by always falling back
    assert empirical_violations > violations  # thresholding picks the 0.11-0.13 points often


def test_bounded_losses_use_hoeffding_bentkus():
    cand = Point("snapkv", 0.5)
    full, drop = np.full(200, 100.0), np.full(200, 100.0)
    drop[:10] = 50.0  # 10 requests lose half their utility
    losses = candidate_losses(drop, full, 0.0, "bounded")
    assert losses.max() == 0.5 and losses.mean() == pytest.approx(0.025)
    table = LossTable([("t", 1, str(i)) for i in range(200)], {cand: losses}, loss="bounded")
    cert = certify(table, Contract(alpha=0.1, delta=0.1, loss="bounded"))
    assert cert.candidates[0].p_value == pytest.approx(hoeffding_bentkus_pvalue(0.025, 200, 0.1))
    assert cert.chosen == cand


def test_binary_loss_respects_epsilon():
    full = np.array([100.0, 100.0, 50.0, 0.0])
    cand = np.array([100.0, 90.0, 30.0, 100.0])
    assert candidate_losses(cand, full, 0.0).tolist() == [0, 1, 1, 0]
    assert candidate_losses(cand, full, 15.0).tolist() == [0, 0, 1, 0]
    with pytest.raises(ValueError, match="epsilon"):
        candidate_losses(cand, full, -1.0)


def _row(task, sample, policy, ratio, score, length=1024, bytes_full=1000):
    key = CellKey("m", task, length, str(sample), policy, ratio, False)
    kept = int(bytes_full * (1 - ratio)) if policy != "full" else bytes_full
    return CellResult(key, "", score, ["x"], 10, kept, bytes_full, 0.1, 0.1, {})


@pytest.fixture
def store(tmp_path):
    rng = np.random.default_rng(4)
    rows = []
    for task, fail in (("niah_single_1", 0.0), ("vt", 0.3)):
        for i in range(60):
            rows.append(_row(task, i, "full", 0.0, 100.0))
            rows.append(_row(task, i, "snapkv", 0.5, 0.0 if rng.random() < fail else 100.0))
    with ResultsStore(tmp_path / "r.sqlite") as s:
        s.add_many(rows)
    return tmp_path / "r.sqlite"


def test_loss_table_from_store_and_mismatch_errors(store):
    with ResultsStore(store) as s:
        table = loss_table(s, "m", [Point("snapkv", 0.5)])
        assert table.n == 120 and table.kept_fraction[Point("snapkv", 0.5)] == pytest.approx(0.5)
        with pytest.raises(ValueError, match="no rows for candidate knorm@0.5"):
            loss_table(s, "m", [Point("knorm", 0.5)])
        with pytest.raises(ValueError, match="no full-KV rows"):
            loss_table(s, "other-model", [Point("snapkv", 0.5)])
        s.add(_row("vt", 999, "snapkv", 0.5, 100.0))  # a candidate row without full KV
        s.add(_row("vt", 1000, "full", 0.0, 100.0))  # a full-KV row without the candidate
        s.add(_row("qa_2", 1, "full", 0.0, 0.0))
        table = loss_table(s, "m", [Point("snapkv", 0.5)])
        assert table.n == 120 and table.left_out == [("qa_2", 1024, "1"), ("vt", 1024, "1000"), ("vt", 1024, "999")]
        assert table.left_out_summary().endswith("have: qa_2 (1), vt (2)")
        s.add(_row("cwe", 1, "full", 0.0, 100.0))
        s.add(_row("cwe", 2, "snapkv", 0.5, 100.0))
        with pytest.raises(ValueError, match="share no request"):
            loss_table(s, "m", [Point("snapkv", 0.5)], tasks=["cwe"])


def test_conditional_contract_round_trip_and_runtime(store, tmp_path):
    with ResultsStore(store) as s:
        table = loss_table(s, "m", [Point("snapkv", 0.5)])
    contract = Contract(alpha=0.1, delta=0.1)
    out = certify_buckets(table, contract, "m", by="task_family")
    assert set(out.buckets) == {"retrieval", "multi_hop"}
    assert all(c.delta == pytest.approx(0.05) for c in out.buckets.values())  # Bonferroni over 2 buckets
    assert out.buckets["retrieval"].chosen == Point("snapkv", 0.5)
    assert out.buckets["multi_hop"].fell_back
    path = out.write(tmp_path / "contract.json")
    assert json.loads(path.read_text())["buckets"]["multi_hop"]["fell_back"] is True
    certified = CertifiedPolicy.from_contract(path)
    point = certified.operating_point(task="niah_single_2")
    assert (point.point.spec, point.point.ratio, point.fell_back) == ("snapkv", 0.5, False)
    assert point.policy.name == "snapkv"
    vt = certified.operating_point(task="vt")
    assert vt.fell_back and vt.point.ratio == 0.0 and vt.point.is_full and vt.policy.name == "full"
    assert certified.operating_point(task="qa_1").reason == "bucket 'qa' was not calibrated"
    with pytest.raises(ValueError, match="task="):
        certified.operating_point()


def test_conditional_bucket_with_too_few_requests_falls_back(store):
    with ResultsStore(store) as s:
        table = loss_table(s, "m", [Point("snapkv", 0.5)])
    out = certify_buckets(table.subset(list(range(0, 120, 4))), Contract(alpha=0.1, delta=0.1), "m",
                          by="task_family")
    assert all(c.fell_back and "too few requests" in c.reason for c in out.buckets.values())
    with pytest.raises(InsufficientCalibrationError):
        certify_buckets(table.subset(list(range(10))), Contract(), "m")


def test_contract_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ContractFile.read(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="not a kvsieve contract"):
        ContractFile.read(tmp_path / "bad.json")


def test_split_validity_counts_violations():
    rng = np.random.default_rng(5)
    risks = {Point("a", 0.5): 0.08, Point("a", 0.75): 0.12}
    table = _table(risks, 400, rng)
    result = split_validity(table, Contract(alpha=0.1, delta=0.1), splits=50, seed=0)
    assert result.n_calibration == 200 and result.certified.splits == 50
    assert result.certified.violation_rate <= result.empirical.violation_rate
    assert sum(result.certified.choices.values()) == 50
    assert 0.25 <= result.certified.mean_retention <= 1.0


def test_certify_cli_writes_a_contract(store, tmp_path, capsys):
    from kvsieve.cli import main

    out = tmp_path / "c.json"
    assert main(["certify", "--store", str(store), "--model", "m", "--policies", "snapkv", "--ratios", "0.5",
                 "--by", "task_family", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "[retrieval]" in printed and "-> snapkv@0.5" in printed and "-> full KV" in printed
    assert CertifiedPolicy.from_contract(out).operating_point(task="niah_single_1").point.ratio == 0.5
    assert main(["certify", "--store", str(store), "--model", "m", "--policies", "snapkv", "--ratios", "0.5",
                 "--delta", "0", "--out", str(out)]) == 2
    assert "delta must be in (0, 1), got 0.0" in capsys.readouterr().err


@pytest.mark.model
def test_certify_run_evaluates_then_refuses_too_few_requests(tmp_path, capsys):
    from kvsieve.cli import main

    store = tmp_path / "cal.sqlite"
    code = main(["certify", "--run", "--store", str(store), "--model", "smollm2-135m", "--policies", "knorm",
                 "--ratios", "0.5", "--tasks", "niah_single_1", "--lengths", "512", "--samples", "3",
                 "--out", str(tmp_path / "c.json")])
    assert code == 2
    assert "needs n >= log(delta)/log(1-alpha) = 22" in capsys.readouterr().err
    with ResultsStore(store) as s:  # the evaluated calibration cells are kept
        assert s.count(policy="full") == 3 and s.count(policy="knorm", ratio=0.5) == 3
    assert not (tmp_path / "c.json").exists()


def test_length_and_task_buckets(store):
    with ResultsStore(store) as s:
        table = loss_table(s, "m", [Point("snapkv", 0.5)])
    assert {k: len(v) for k, v in table.buckets("task").items()} == {"niah_single_1": 60, "vt": 60}
    assert list(table.buckets("length", [512, 2048])) == ["<=2048"]
    with pytest.raises(ValueError, match="length_edges"):
        table.buckets("length")
    with pytest.raises(ValueError, match="none, task, task_family, length"):
        table.buckets("model")
    out = certify_buckets(table, Contract(alpha=0.1, delta=0.1), "m", by="length", length_edges=[1000, 4000])
    certified = CertifiedPolicy(out)
    assert certified.operating_point(context_tokens=3000).point.ratio == 0.0  # the pooled bucket fails (vt)
    assert certified.operating_point(context_tokens=900).reason == "bucket '<=1000' was not calibrated"
    with pytest.raises(ValueError, match="context_tokens="):
        certified.operating_point(task="vt")


# ---------------------------------------------------------------------------------------------- issue 17


def test_epsilon_outside_the_utility_range_is_refused():
    for bad in (100.0, 500.0, -0.5, float("nan")):
        with pytest.raises(ValueError, match=r"epsilon must be in \[0, 100\) .* got"):
            Contract(epsilon=bad)
    assert Contract(epsilon=99.5).epsilon == 99.5


def test_certify_cli_refuses_epsilon_500_and_ratio_1(store, tmp_path, capsys):
    from kvsieve.cli import main

    base = ["certify", "--store", str(store), "--model", "m", "--policies", "snapkv", "--out", str(tmp_path / "c.json")]
    assert main([*base, "--ratios", "0.5", "--epsilon", "500"]) == 2
    assert "epsilon must be in [0, 100)" in capsys.readouterr().err
    assert main([*base, "--ratios", "1.0"]) == 2
    err = capsys.readouterr().err
    assert "ratio 1.0; a compression ratio is in [0, 1)" in err and "1.0 is out of range" in err
    assert "no rows" not in err
    assert not (tmp_path / "c.json").exists()


def test_candidates_for_checks_ratios_and_reads_decode_labels():
    with pytest.raises(ValueError, match=r"policy 'snapkv' has ratio 1.0; a compression ratio is in \[0, 1\)"):
        candidates_for(["snapkv"], [0.5, 1.0])
    spec = "learned(checkpoint='smollm2-135m-instruct')@decode128"
    cands = candidates_for(["full", "full@decode128", spec], [0.5])
    assert cands == [Point.parse(spec, 0.5)]
    cand = cands[0]
    assert (cand.spec, cand.chunk_size, cand.mode.name, cand.reference.stored) == (spec[:-10], 128, "decode",
                                                                              "full@decode128")
    assert "question read under eviction" in cand.setting
    assert Point("snapkv", 0.5).setting == "query-agnostic prefill"
    assert Point("snapkv", 0.5, True).setting == "question-aware prefill"
    with pytest.raises(ValueError, match="question is read under eviction anyway"):
        Point.parse("snapkv@decode64", 0.5, True)  # no question-aware decode-time point is made
    with pytest.raises(ValueError, match="question is read under eviction anyway"):
        candidates_for(["snapkv@decode64"], [0.5], question_aware=True)


def _model_row(model, task, sample, policy, ratio, score, kept_bytes, bytes_full=1000, digest=None):
    key = CellKey(model, task, 1024, str(sample), policy, ratio, False)
    return CellResult(key, "", score, ["x"], 10, kept_bytes, bytes_full, 0.1, 0.1, {"policy_digest": digest})


def test_decode_rows_certify_against_full_decode_with_an_honest_label(tmp_path):
    spec = "learned(checkpoint='smollm2-135m-instruct')@decode128"
    digest = parse(spec.split("@")[0]).digest  # the shipped checkpoint's bytes, which the rows were computed with
    rows = []
    for i in range(40):
        rows.append(_model_row("m", "niah_single_1", i, "full", 0.0, 0.0, 1000))  # prefill full: all wrong
        rows.append(_model_row("m", "niah_single_1", i, "full@decode128", 0.0, 100.0, 1000))
        rows.append(_model_row("m", "niah_single_1", i, spec, 0.5, 100.0, 600, digest=digest))
    with ResultsStore(tmp_path / "d.sqlite") as s:
        s.add_many(rows)
        table = loss_table(s, "m", candidates_for([spec], [0.5]))
    cand = Point.parse(spec, 0.5)
    assert table.references == {cand: "full@decode128"} and table.losses[cand].sum() == 0
    cert = certify(table, Contract(alpha=0.1, delta=0.1))
    assert cert.chosen == cand
    # one "kept" figure: the bytes (0.600, sinks and window on top of the budget), not 1 - ratio (0.500)
    assert cert.verdict() == (f"{spec}@0.5 (decode-time eviction every 128 tokens, question read under eviction): "
                              "keeps 0.600 of the cache bytes at compression ratio 0.5")
    assert "0.600" in cert.table_lines()[1] and "0.500" not in cert.table_lines()[1]
    path = certify_buckets(table, Contract(alpha=0.1, delta=0.1), "m").write(tmp_path / "c.json")
    saved = json.loads(path.read_text())["buckets"]["all"]["candidates"][0]
    assert saved["setting"].startswith("decode-time eviction") and saved["policy"] == spec


def test_least_cache_is_measured_in_bytes():
    # b@0.5 keeps fewer bytes than a@0.75 (a protects more tokens): b wins though its ratio is lower
    a, b = Point("a", 0.75), Point("b", 0.5)
    table = LossTable([("t", 1, str(i)) for i in range(60)], {a: np.zeros(60), b: np.zeros(60)},
                      kept_fraction={a: 0.55, b: 0.52})
    assert certify(table, Contract(alpha=0.1, delta=0.1)).chosen == b


def test_loss_table_resolves_aliases_and_lists_the_stored_models(tmp_path):
    canonical, alias = "qwen2.5-coder-0.5b-instruct", "qwen2.5-0.5b"
    rows = []
    for i in range(30):
        model = canonical if i < 20 else alias  # an older store keyed some rows by the alias
        rows.append(_model_row(model, "vt", i, "full", 0.0, 100.0, 1000))
        rows.append(_model_row(model, "vt", i, "snapkv", 0.5, 100.0, 500))
    rows.append(_model_row("smollm2-135m-instruct", "vt", 0, "full", 0.0, 100.0, 1000))
    with ResultsStore(tmp_path / "a.sqlite") as s:
        s.add_many(rows)
        for name in (alias, canonical):
            table = loss_table(s, name, [Point("snapkv", 0.5)])
            assert table.n == 30 and table.model == canonical
        with pytest.raises(ValueError, match=r"no full-KV rows for model 'smollm2'; it holds full-KV rows for: "
                                             r"qwen2.5-0.5b, qwen2.5-coder-0.5b-instruct, smollm2-135m-instruct"):
            loss_table(s, "smollm2", [Point("snapkv", 0.5)])


def test_certify_refuses_rows_computed_from_other_bytes_than_the_file_now_holds(tmp_path, capsys):
    """Issue 52: a contract records the files' digests as they are now, so each row's policy_digest must match."""
    import hashlib

    from kvsieve.cli import main

    program = tmp_path / "p.py"
    program.write_text('SELECTION = {"chunk_size": 1}\ndef score(f):\n    return group_mean(f.attn)\n')
    label = f"program:{program}"
    digest = parse(label).digest
    assert digest == hashlib.sha256(program.read_bytes()).hexdigest()  # the program file's own sha256
    def rows(first_digest):
        return [row for i in range(40) for row in (_model_row("m", "vt", i, "full", 0.0, 100.0, 1000),
                _model_row("m", "vt", i, label, 0.5, 100.0, 500, digest=digest if i else first_digest))]

    with ResultsStore(tmp_path / "old.sqlite") as s:
        s.add_many(rows(None))  # the first row written before digests were recorded
        with pytest.raises(ValueError, match=rf"1 of 40 rows of candidate {label}@0.5 were computed from other "
                                             rf"file contents \(sha256 unrecorded; first: task vt, length 1024, "
                                             rf"sample 0\), but its files now have sha256 {digest[:12]}"):
            loss_table(s, "m", [Point(label, 0.5)])
    with ResultsStore(tmp_path / "s.sqlite") as s:
        s.add_many(rows(digest))
        assert loss_table(s, "m", [Point(label, 0.5)]).n == 40
    program.write_text(program.read_text() + "# edited after the rows were computed\n")
    args = ["certify", "--store", str(tmp_path / "s.sqlite"), "--model", "m", "--policies", label, "--ratios", "0.5",
            "--out", str(tmp_path / "c.json")]
    assert main(args) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"40 of 40 rows of candidate {label}@0.5 were computed from other file contents (sha256 {digest[:12]};" \
        in err
    assert f"now have sha256 {parse(label).digest[:12]}" in err
    assert not (tmp_path / "c.json").exists()
