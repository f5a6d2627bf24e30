"""Headline statistics: pairing, % of full, bytes and overhead re-derived by hand on a small synthetic store (the
bootstrap itself: tests/test_bootstrap.py)."""

from __future__ import annotations

import pytest

from kvsieve.harness.headline import headline_report
from kvsieve.harness.headline_format import format_comparisons, format_headline
from kvsieve.harness.headline_tables import NOT_DISTINGUISHABLE, compare, headline
from kvsieve.harness.store import CellKey, CellResult, ResultsStore
from kvsieve.policies.label import Point


def cell(policy: str, ratio: float, sample: str, score: float, cache_bytes: int = 100, full_bytes: int = 100,
         prefill: float = 10.0, task: str = "t", model: str = "m", qa: bool = False,
         length: int = 1024) -> CellResult:
    return CellResult(CellKey(model, task, length, sample, policy, ratio, qa), "p", score, ["a"], 1, cache_bytes,
                      full_bytes, prefill, 0.0, {})


# -- the table -------------------------------------------------------------------------------------------------


@pytest.fixture
def rows() -> list[CellResult]:
    return [
        # full on s0..s3 (s4 has no full row)
        cell("full", 0.0, "s0", 100, prefill=10.0), cell("full", 0.0, "s1", 100, prefill=12.0),
        cell("full", 0.0, "s2", 50, prefill=10.0), cell("full", 0.0, "s3", 0, prefill=8.0),
        # tova at 0.5 on s0..s4: s4 is unpaired and must not count
        cell("tova", 0.5, "s0", 100, 50, 100, 11.0), cell("tova", 0.5, "s1", 0, 40, 80, 13.0),
        cell("tova", 0.5, "s2", 50, 50, 100, 10.5), cell("tova", 0.5, "s3", 0, 60, 100, 8.5),
        cell("tova", 0.5, "s4", 0, 50, 100, 9.0),
        # kvzip at 0.5 on s0, s1, s3 only
        cell("kvzip", 0.5, "s0", 100, 70, 100, 30.0), cell("kvzip", 0.5, "s1", 100, 70, 100, 36.0),
        cell("kvzip", 0.5, "s3", 100, 70, 100, 24.0),
        # the oracle is question-aware
        cell("oracle", 0.5, "s0", 100, prefill=12.0, qa=True),
        cell("oracle", 0.5, "s1", 100, prefill=13.0, qa=True),
        # a policy with no full row anywhere (another task)
        cell("knorm", 0.5, "x0", 100, task="other"),
    ]


def test_headline_pairs_with_full_and_rederives_each_column(rows):
    (table,) = headline(rows)
    assert (table.model, table.length, table.requests) == ("m", 1024, 4)
    by = {(r.policy, r.ratio): r for r in table.rows}
    tova = by[("tova", 0.5)]
    assert tova.n == 4 and tova.unpaired == 1
    assert tova.mean == pytest.approx((100 + 0 + 50 + 0) / 4)  # 37.5; s4 dropped
    assert tova.full_mean == pytest.approx((100 + 100 + 50 + 0) / 4)  # 62.5
    assert tova.pct_of_full == pytest.approx(100 * 37.5 / 62.5)  # 60
    assert tova.bytes_pct == pytest.approx(100 * (0.5 + 0.5 + 0.5 + 0.6) / 4)  # 52.5
    # prefill means: tova (11 + 13 + 10.5 + 8.5) / 4 = 10.75, full (10 + 12 + 10 + 8) / 4 = 10
    assert tova.overhead_pct == pytest.approx(7.5)
    kvzip = by[("kvzip", 0.5)]
    assert kvzip.n == 3 and kvzip.unpaired == 0
    assert kvzip.full_mean == pytest.approx((100 + 100 + 0) / 3)  # full on kvzip's requests only
    assert kvzip.pct_of_full == pytest.approx(150.0)
    assert kvzip.low == kvzip.high == pytest.approx(100.0)
    assert kvzip.overhead_pct == pytest.approx(100 * (30.0 - 10.0) / 10.0)  # means 30 vs 10
    assert by[("oracle+qa", 0.5)].n == 2
    full = by[("full", 0.0)]
    assert (full.n, full.mean, full.pct_of_full, full.bytes_pct, full.overhead_pct) == (4, 62.5, 100, 100, 0)
    assert table.unpaired == ["knorm @ 0.5"]
    # order: full, then ordinary policies by mean (kvzip 100 before tova 37.5), then reference policies
    assert [r.policy for r in table.rows] == ["full", "kvzip", "tova", "oracle+qa"]


def test_headline_never_pools_models_or_lengths(rows):
    other = [cell("full", 0.0, "s0", 0, model="m2"), cell("tova", 0.5, "s0", 0, model="m2"),
             cell("full", 0.0, "s0", 100, length=2048), cell("tova", 0.5, "s0", 100, length=2048)]
    tables = headline(rows + other)
    assert [(t.model, t.length) for t in tables] == [("m", 1024), ("m", 2048), ("m2", 1024)]
    assert {(r.policy, r.mean) for r in tables[2].rows} == {("full", 0.0), ("tova", 0.0)}
    assert next(r for r in tables[0].rows if r.policy == "tova").mean == pytest.approx(37.5)


def test_each_prompt_layout_gets_its_own_table_and_comparisons(tmp_path, rows):
    # the same requests' ids on the second layout (fmt2:...), scored differently: never one mean over both
    alt = [cell("full", 0.0, "s0", 100, task="fmt2:t"), cell("full", 0.0, "s1", 100, task="fmt2:t"),
           cell("tova", 0.5, "s0", 0, task="fmt2:t"), cell("tova", 0.5, "s1", 50, task="fmt2:t")]
    first, second = headline(rows + alt)
    assert (first.layout, second.layout) == ("", "fmt2") and second.tasks == ["fmt2:t"]
    assert next(r for r in first.rows if r.policy == "tova").mean == pytest.approx(37.5)  # as without fmt2 rows
    tova = next(r for r in second.rows if r.policy == "tova")
    assert (tova.n, tova.mean, tova.full_mean) == (2, 25.0, 100.0)
    assert "layout fmt2: 2 requests" in format_headline(second)
    with pytest.raises(ValueError, match="one prompt layout"):
        compare(rows + alt, "tova", "full", 0.5)
    assert compare(alt, "tova", "full", 0.5).diff == pytest.approx(-75.0)
    with ResultsStore(tmp_path / "s.sqlite") as store:
        store.add_many(rows + alt)
    text = headline_report([tmp_path / "s.sqlite"], compare_pairs=[("tova", "full")])
    assert text.count("| tova | full | 0.5 |") == 2 and "| tova | full | 0.5 | 2 | -75.0 |" in text


def test_partly_timed_rows_are_named_once_per_count():
    """The note on partly timed rows groups them by count: a policy whose every ratio shares a count is named once,
    one whose ratios differ is named with the ratios of each count."""
    rows = []
    for sample in ("s0", "s1", "s2"):
        rows.append(cell("full", 0.0, sample, 100, prefill=10.0))
        for policy in ("tova", "kvzip"):
            for ratio in (0.5, 0.75):
                rows.append(cell(policy, ratio, sample, 50, prefill=10.0))
    for row in rows:
        key = row.key
        timed_row = key.sample_id == "s0" or (key.sample_id == "s1" and key.policy == "kvzip" and key.ratio == 0.75)
        if timed_row and key.policy != "full":
            row.config.update(prefill_only_seconds=9.0, compress_seconds=0.1)
    note = format_headline(headline(rows)[0]).split("recorded it): ")[1].split("\n")[0]
    assert note == "1 of 3: kvzip @ 0.5, tova; 2 of 3: kvzip @ 0.75"


def test_decode_cells_pair_with_the_decode_full_cells():
    assert Point.parse("tova@decode128").reference.stored == "full@decode128"
    assert Point.parse("learned(checkpoint='a@b')").reference.stored == "full"
    rows = [cell("full", 0.0, "s0", 100), cell("full@decode128", 0.0, "s0", 50),
            cell("tova@decode128", 0.5, "s0", 25), cell("full@decode128e4", 0.0, "s0", 40),
            cell("tova@decode128e4", 0.5, "s0", 30)]
    (table,) = headline(rows)
    tova = next(r for r in table.rows if r.policy == "tova@decode128")
    assert tova.full_mean == 50 and tova.pct_of_full == pytest.approx(50.0)
    # evicting every 4 generated tokens pairs with the full cache read the same way (was paired with "full")
    every4 = next(r for r in table.rows if r.policy == "tova@decode128e4")
    assert every4.full_mean == 40 and every4.pct_of_full == pytest.approx(75.0)
    assert [r.policy for r in table.rows[:3]] == ["full", "full@decode128", "full@decode128e4"]


def test_overhead_comes_from_each_cells_own_timing_when_recorded():
    """A cell that timed its compression and its sample's prefill in one process is its own reference: the full
    cells' prefill (here from a slower run) no longer enters; cells without it (older rows) are left out of the
    figure, and only where no cell has it does the full cells' prefill serve."""
    timed = [cell("full", 0.0, "s0", 100, prefill=20.0), cell("full", 0.0, "s1", 100, prefill=20.0),
             cell("tova", 0.5, "s0", 100, prefill=10.2), cell("tova", 0.5, "s1", 100, prefill=12.6)]
    timed[2].config.update(prefill_only_seconds=10.0, compress_seconds=0.2)
    timed[3].config.update(prefill_only_seconds=12.0, compress_seconds=0.6)
    (table,) = headline(timed)
    tova = next(r for r in table.rows if r.policy == "tova")
    assert tova.overhead_pct == pytest.approx(100 * (0.2 + 0.6) / 2 / ((10.0 + 12.0) / 2))  # 3.6364
    assert tova.overhead_cells == 2 and "timed their own" not in format_headline(table)
    del timed[3].config["compress_seconds"]
    (table,) = headline(timed)
    tova = next(r for r in table.rows if r.policy == "tova")
    assert tova.overhead_pct == pytest.approx(100 * 0.2 / 10.0)  # the timed cell alone: 2.0
    assert tova.overhead_cells == 1 and "recorded it): 1 of 2: tova\n" in format_headline(table)
    for row in timed[:2]:
        row.config.update(prefill_only_seconds=20.0, compress_seconds=0.0)
    timed[1].config.pop("compress_seconds")
    assert "timed their own compression and prefill (the others ran before grids recorded it): every row, 1 of 2" \
        in format_headline(headline(timed)[0])
    del timed[2].config["compress_seconds"]
    (table,) = headline(timed)
    tova = next(r for r in table.rows if r.policy == "tova")
    assert tova.overhead_pct == pytest.approx(100 * ((10.2 + 12.6) / 2 - 20.0) / 20.0)  # -43
    assert tova.overhead_cells == 0


def test_format_headline_names_model_and_requests(rows):
    text = format_headline(headline(rows)[0])
    lines = text.splitlines()
    assert lines[0] == "### m at 1024 tokens: 4 requests, 2 tasks"
    assert "| tova | 0.5 | 37.5 |" in text and text.count("| 4 |") >= 2
    assert "tova @ 0.5: 1" in text and "knorm @ 0.5" in text
    assert "negative overhead" not in text
    slower_full = [cell("full", 0.0, "s0", 100, prefill=20.0), cell("tova", 0.5, "s0", 100, prefill=10.0)]
    assert "negative overhead" in format_headline(headline(slower_full)[0])
    kvzip = next(line for line in lines if line.startswith("| kvzip"))
    # full scores 100, 100, 0 on kvzip's 3 requests: resampled full means 100 k / 3 (k = 0 left out), so % of
    # full is 300 / k, between 100 and 300
    assert kvzip == "| kvzip | 0.5 | 100.0 | [100.0, 100.0] | 150.0 | [100, 300] | 70.0 | 200.0 | 3 |"


# -- comparisons -----------------------------------------------------------------------------------------------


def test_compare_pairs_requests_and_says_when_not_distinguishable(rows):
    c = compare(rows, "kvzip", "tova", 0.5)
    # shared requests s0, s1, s3: differences 0, 100, 100
    assert c.n == 3 and c.diff == pytest.approx(200 / 3)
    assert c.low == pytest.approx(0.0) and c.verdict == NOT_DISTINGUISHABLE and not c.distinguishable
    const = [cell("a", 0.5, f"s{i}", 60) for i in range(5)] + [cell("b", 0.5, f"s{i}", 50) for i in range(6)]
    c = compare(const, "a", "b", 0.5)
    assert (c.n, c.diff, c.low, c.high) == (5, 10.0, 10.0, 10.0) and c.verdict == "a better"
    assert compare(const, "b", "a", 0.5).verdict == "a better"
    # a full-cache side is taken at ratio 0; "oracle" resolves to its only label, oracle+qa
    vs_full = compare(rows, "oracle", "full", 0.5)
    assert (vs_full.a, vs_full.b, vs_full.n, vs_full.diff) == ("oracle+qa", "full", 2, 0.0)
    table = format_comparisons([c])
    assert "| a | b | 0.5 | 5 | +10.0 | [+10.0, +10.0] | a better |" in table


def test_compare_errors_name_what_is_missing(rows):
    with pytest.raises(ValueError, match="'nope' has no rows.*available: full"):
        compare(rows, "nope", "tova", 0.5)
    with pytest.raises(ValueError, match="no rows at ratio 0.9.*its ratios: 0.5"):
        compare(rows, "tova", "kvzip", 0.9)
    two = rows + [cell("tova", 0.5, "s0", 0, model="m2")]
    with pytest.raises(ValueError, match="several models.*m @ 1024, m2 @ 1024"):
        compare(two, "kvzip", "tova", 0.5)
    assert compare(two, "kvzip", "tova", 0.5, model="m").n == 3


def test_headline_report_from_a_store(tmp_path, rows):
    path = tmp_path / "r.sqlite"
    with ResultsStore(path) as store:
        store.add_many(rows + [cell("full", 0.0, "s0", 0, model="m2")])
    text = headline_report([path], compare_pairs=[("kvzip", "tova"), ("tova", "full")])
    assert "### m at 1024 tokens: 4 requests" in text and "### m2 at 1024 tokens: 1 requests" in text
    assert "| kvzip | tova | 0.5 | 3 | +66.7 |" in text
    assert "| tova | full | 0.5 | 4 | -25.0 |" in text
    # m2 holds only the full cache: its table notes the pairs it lacks in one short line each
    assert "kvzip vs tova: not in this table (policy 'kvzip' has no rows for model m2)\n" in text
    only = headline_report([path], model="m2")
    assert "### m2" in only and "### m " not in only
    with pytest.raises(ValueError, match="no rows for model nope.*models held: m, m2"):
        headline_report([path], model="nope")
    with pytest.raises(ValueError, match="does not exist"):
        headline_report([tmp_path / "missing.sqlite"])


def test_replicate_stores_pool_into_one_table_and_never_count_a_cell_twice(tmp_path, rows):
    # two test sets of the same model, one store each: pooled, tova's paired requests are s0-s3 and r0-r1
    second = [cell("full", 0.0, "r0", 100), cell("full", 0.0, "r1", 50),
              cell("tova", 0.5, "r0", 100, 50, 100), cell("tova", 0.5, "r1", 0, 50, 100)]
    first_path, second_path = tmp_path / "a.sqlite", tmp_path / "b.sqlite"
    with ResultsStore(first_path) as store:
        store.add_many(rows)
    with ResultsStore(second_path) as store:
        store.add_many(second)
    text = headline_report([first_path, second_path], compare_pairs=[("tova", "full")])
    # by hand: tova (100 + 0 + 50 + 0 + 100 + 0) / 6 = 41.7, full (100 + 100 + 50 + 0 + 100 + 50) / 6 = 66.7
    assert "### m at 1024 tokens: 6 requests" in text
    assert "| tova | full | 0.5 | 6 | -25.0 |" in text
    tova_row = next(line for line in text.splitlines() if line.startswith("| tova | 0.5 |"))
    assert "| 41.7 |" in tova_row and "| 62.5 |" in tova_row  # 41.7 / 66.7 = 62.5% of full
    with ResultsStore(second_path) as store:  # the same request scored in both stores would count twice
        store.add(cell("tova", 0.5, "s0", 100, 50, 100))
    with pytest.raises(ValueError, match="in both .*a.sqlite and .*b.sqlite"):
        headline_report([first_path, second_path])


def test_headline_report_refuses_a_pair_no_model_has(tmp_path, rows):
    path = tmp_path / "r.sqlite"
    with ResultsStore(path) as store:
        store.add_many(rows)
    with pytest.raises(ValueError, match="cannot compare.*nope vs tova.*'nope' has no rows for model m"):
        headline_report([path], compare_pairs=[("nope", "tova")])
