"""Score tables (report.py) and their plots (report_plots.py) from a tiny synthetic result list with hand-computed
means."""

from __future__ import annotations

import pytest

from kvsieve.harness.report import by_model, format_summary, format_table, report_text, score_table
from kvsieve.harness.report_plots import (
    line_styles,
    plot_scores,
    plot_task_panels,
    scores_figure,
    task_panels_figure,
    write_plots,
)
from kvsieve.harness.store import CellKey, CellResult, ResultsStore
from kvsieve.policies.label import Point


def cell(task: str, policy: str, ratio: float, score: float, sample: str = "s0", qa: bool = False,
         model: str = "m") -> CellResult:
    return CellResult(key=CellKey(model, task, 1024, sample, policy, ratio, qa), prediction="p", score=score,
                      answers=["a"], kept_tokens=10, cache_bytes=10, cache_bytes_full=20, prefill_seconds=0.0,
                      decode_seconds=0.0, config={})


@pytest.fixture
def results() -> list[CellResult]:
    return [
        # full cache, only at ratio 0
        cell("qa", "full", 0.0, 1.0, "s0"), cell("qa", "full", 0.0, 0.5, "s1"),   # qa: 0.75
        cell("sum", "full", 0.0, 0.25, "s0"), cell("sum", "full", 0.0, 0.75, "s1"),  # sum: 0.5
        # snapkv at 0.5: qa (1 + 0) / 2 = 0.5, sum 0.25
        cell("qa", "snapkv", 0.5, 1.0, "s0"), cell("qa", "snapkv", 0.5, 0.0, "s1"),
        cell("sum", "snapkv", 0.5, 0.25, "s0"),
        # knorm at 0.5: qa only (sum missing) -> 0.2
        cell("qa", "knorm", 0.5, 0.2, "s0"),
        # question-aware snapkv at 0.5: qa 0.9, sum (0.5 + 0.7) / 2 = 0.6
        cell("qa", "snapkv", 0.5, 0.9, "s0", qa=True),
        cell("sum", "snapkv", 0.5, 0.5, "s0", qa=True), cell("sum", "snapkv", 0.5, 0.7, "s1", qa=True),
        # oracle at 0.5: qa 1.0, sum 0.8
        cell("qa", "oracle(window=16)", 0.5, 1.0), cell("sum", "oracle(window=16)", 0.5, 0.8),
        # snapkv at 0.8: qa 0.1, sum 0.3
        cell("qa", "snapkv", 0.8, 0.1), cell("sum", "snapkv", 0.8, 0.3),
    ]


def test_reference_lines_are_dashed_and_an_unregistered_family_is_an_ordinary_line():
    labels = ["snapkv", "snapkv+qa", "oracle", "oracle(window=16)", "gone_family(x=1)", "full"]
    styles = line_styles(map(Point.parse, labels))
    assert {p for p, (_, linestyle, _) in styles.items() if linestyle == "--"} == {"snapkv+qa", "oracle",
                                                                                  "oracle(window=16)"}
    assert list(styles)[0] == "full"  # the full cache first, the references last
    assert set(list(styles)[-3:]) == {"snapkv+qa", "oracle", "oracle(window=16)"}


def test_score_table_means(results):
    table = score_table(results)
    assert sorted(table) == [0.0, 0.5, 0.8]
    assert table[0.0] == {"qa": {"full": (0.75, 2)}, "sum": {"full": (0.5, 2)}}
    assert table[0.5]["qa"] == {"snapkv": (0.5, 2), "knorm": (0.2, 1), "snapkv+qa": (0.9, 1),
                                "oracle(window=16)": (1.0, 1)}
    assert table[0.5]["sum"]["snapkv"] == (0.25, 1)
    assert table[0.5]["sum"]["snapkv+qa"] == pytest.approx((0.6, 2))
    assert "knorm" not in table[0.5]["sum"]
    assert table[0.8] == {"qa": {"snapkv": (0.1, 1)}, "sum": {"snapkv": (0.3, 1)}}
    assert score_table([]) == {}


def test_score_table_rounds_ratios():
    table = score_table([cell("qa", "a", 0.1 + 0.2, 1.0), cell("qa", "a", 0.3, 0.0, sample="s1")])
    assert table == {0.3: {"qa": {"a": (0.5, 2)}}}


def test_format_table_text(results):
    text = format_table(score_table(results), 0.5)
    lines = text.splitlines()
    # columns: full first, then ordinary policies, then reference policies; rows: tasks then average
    assert lines[0].split() == ["task", "full", "knorm", "snapkv", "oracle(window=16)", "snapkv+qa"]
    assert lines[2].split() == ["qa", "0.750", "0.200", "0.500", "1.000", "0.900"]
    assert lines[3].split() == ["sum", "0.500", "-", "0.250", "0.800", "0.600"]
    # average of per-task means: full (0.75 + 0.5) / 2, knorm incomplete, snapkv (0.5 + 0.25) / 2, ...
    assert lines[-1].split() == ["average", "0.625", "-", "0.375", "0.900", "0.750"]
    assert len({len(line) for line in lines[:2]}) == 1  # aligned header and rule


def test_format_table_full_column_in_every_ratio(results):
    table = score_table(results)
    lines = format_table(table, 0.8).splitlines()
    assert lines[0].split() == ["task", "full", "snapkv"]
    assert lines[2].split() == ["qa", "0.750", "0.100"]
    assert lines[-1].split() == ["average", "0.625", "0.200"]
    assert format_table(table, 0).splitlines()[0].split() == ["task", "full"]
    with pytest.raises(KeyError, match="0.3"):
        format_table(table, 0.3)
    with pytest.raises(ValueError, match="fmt"):
        format_table(table, 0.5, fmt="html")


def test_format_table_markdown(results):
    md = format_table(score_table(results), 0.5, fmt="markdown")
    assert md == (
        "| task | full | knorm | snapkv | oracle(window=16) | snapkv+qa |\n"
        "|---|---:|---:|---:|---:|---:|\n"
        "| qa | 0.750 | 0.200 | 0.500 | 1.000 | 0.900 |\n"
        "| sum | 0.500 | - | 0.250 | 0.800 | 0.600 |\n"
        "| average | 0.625 | - | 0.375 | 0.900 | 0.750 |\n"
    )
    assert "| average | 0.62 | - | 0.38 |" in format_table(score_table(results), 0.5, fmt="markdown", digits=2)


def test_table_from_store_rows(tmp_path, results):
    with ResultsStore(tmp_path / "r.db") as store:
        store.add_many(results)
        table = score_table(store.rows())
        assert table == score_table(results)
        assert score_table(store.rows(task="qa"))[0.5]["qa"]["snapkv+qa"] == (0.9, 1)


def test_plots_written(tmp_path, results):
    out = plot_scores(results, tmp_path / "plots" / "scores.png")
    assert out.exists() and out.stat().st_size > 1000
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    panels = plot_task_panels(results, tmp_path / "plots" / "tasks.png")
    assert panels.exists() and panels.stat().st_size > 1000
    assert panels.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    many = [cell(f"t{i}", "snapkv", r, r) for i in range(5) for r in (0.25, 0.5)]
    assert plot_task_panels(many, tmp_path / "many.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="no results"):
        plot_scores([], tmp_path / "empty.png")


def test_plot_line_styles(results):
    from kvsieve.harness import report_plots

    table, tasks, styles, model, n = report_plots._prepare(results)
    assert (model, n) == ("m", 4)  # qa, sum x s0, s1
    fig = report_plots._figure((4, 3))
    ax = fig.add_subplot(1, 1, 1)
    report_plots._draw(ax, table, tasks, styles)
    styles = {line.get_label(): line.get_linestyle() for line in ax.get_lines()}
    # knorm is incomplete (no sum task) so it has no average point; full is a horizontal reference line
    assert styles == {"snapkv": "-", "oracle(window=16)": "--", "snapkv+qa": "--", "full": "--"}
    full_line = next(line for line in ax.get_lines() if line.get_label() == "full")
    assert list(full_line.get_ydata()) == [0.625, 0.625]
    snapkv = next(line for line in ax.get_lines() if line.get_label() == "snapkv")
    assert list(snapkv.get_xdata()) == [0.5, 0.8]
    assert list(snapkv.get_ydata()) == pytest.approx([0.375, 0.2])


def test_summary_averages_over_tasks_per_ratio(results):
    lines = format_summary(score_table(results), digits=3).splitlines()
    assert lines[0] == "| policy | 0.5 | 0.8 |"
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines[2:]}
    assert list(rows)[0] == "full" and rows["full"] == "| full | 0.625 | 0.625 |"
    assert rows["snapkv"] == "| snapkv | 0.375 | 0.200 |"  # (0.5 + 0.25) / 2, (0.1 + 0.3) / 2
    assert rows["knorm"] == "| knorm | - | - |"  # misses a task
    assert rows["snapkv+qa"] == "| snapkv+qa | 0.750 | - |"


# -- issue 17: one model per table and plot, distinguishable lines, legend outside, model and n in titles ------


def test_tables_and_plots_never_pool_models(tmp_path, results):
    other = [cell("qa", "full", 0.0, 0.0, model="m2"), cell("qa", "snapkv", 0.5, 0.0, model="m2")]
    with pytest.raises(ValueError, match="2 models \\(m, m2\\).*never pools"):
        score_table(results + other)
    with pytest.raises(ValueError, match="never pools"):
        plot_scores(results + other, tmp_path / "x.png")
    split = by_model(other + results)
    assert list(split) == ["m", "m2"] and split["m"] == results and split["m2"] == other
    text = report_text(results + other)
    assert "all models" not in text
    assert "## compression ratio 0.5 (m, n = 4 requests)" in text  # qa/sum x s0/s1
    assert "## compression ratio 0.5 (m2, n = 1 requests)" in text
    # m2's full scores 0 and snapkv 0: its summary is not m's (0.625) pooled with it
    m2_summary = text.split("(m2, n = 1 requests)\n\n")[-1]
    assert "| full | 0.0 |" in m2_summary
    paths = write_plots(results + [cell("qa", "full", 0.0, 0.0, model="org/m2"),
                                   cell("qa", "snapkv", 0.5, 0.0, model="org/m2")], tmp_path / "plots")
    assert sorted(p.name for p in paths) == ["scores-m.png", "scores-org_m2.png", "tasks-m.png", "tasks-org_m2.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def many_policies(count: int = 31) -> list:
    names = [f"p{i:02d}" for i in range(count - 3)] + ["oracle", "snapkv+qa", "oracle(window=16)"]
    rows = [cell(t, "full", 0.0, 1.0, sample=s) for t in ("qa", "sum") for s in ("s0", "s1", "s2")]
    for i, name in enumerate(names):
        qa = name.endswith("+qa")
        for t in ("qa", "sum"):
            for s in ("s0", "s1", "s2"):
                for r in (0.5, 0.75):
                    rows.append(cell(t, name.removesuffix("+qa"), r, (i % 7) / 7, sample=s, qa=qa))
    return rows


def test_31_lines_have_distinct_styles_and_the_legend_is_outside():
    styles = line_styles(Point(f"p{i}") for i in range(70))
    assert len(set(styles.values())) == 70
    assert len({(c, m) for c, _, m in styles.values()}) == 70  # colour x marker alone tells them apart

    fig = scores_figure(many_policies(), title="grid")
    ax = fig.axes[0]
    lines = [line for line in ax.get_lines() if line.get_label() != "full"]
    assert len(lines) == 31
    assert len({(line.get_color(), line.get_linestyle(), line.get_marker()) for line in lines}) == 31
    assert {line.get_linestyle() for line in lines if line.get_label() in ("oracle", "snapkv+qa")} == {"--"}
    assert ax.get_title() == "grid: m, average over 2 tasks, n = 6 requests"
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    assert len(ax.get_legend().get_texts()) == 32
    assert not legend.overlaps(ax.get_window_extent(renderer))
    assert legend.x0 >= ax.get_window_extent(renderer).x1


def test_task_panels_titles_and_legend_outside(results):
    fig = task_panels_figure(results)
    assert [ax.get_title() for ax in fig.axes] == ["qa (n = 2)", "sum (n = 2)"]
    assert fig._suptitle.get_text() == "m: score by task, n = 4 requests"
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend = fig.legends[0].get_window_extent(renderer)
    assert all(not legend.overlaps(ax.get_window_extent(renderer)) for ax in fig.axes)


def test_one_lookup_of_a_labels_full_cache_rows():
    """pairing.reference_key: the reference label (full, or full@decodeN for decode-time rows; never +qa) at the
    lowest ratio it was stored at. report's full column uses it too: full stored only at 0.5 is still the reference."""
    from kvsieve.harness.pairing import reference_key
    from kvsieve.harness.report import format_table, score_table
    from kvsieve.harness.store import CellKey, CellResult

    keys = {("full", 0.5), ("full", 0.25), ("snapkv", 0.5), ("full@decode64", 0.5), ("full@decode64", 0.0)}
    assert reference_key(keys, Point("snapkv")) == ("full", 0.25)
    assert reference_key(keys, Point("snapkv", 0.5, True)) == ("full", 0.25)
    assert reference_key(keys, Point.parse("tova@decode64")) == ("full@decode64", 0.0)
    assert reference_key(keys, Point.parse("tova@decode32")) is None

    def row(policy, ratio, score):
        return CellResult(CellKey("m", "t", 1, "0", policy, ratio, False), "", score, ["a"], 1, 1, 1, 0.0, 0.0, {})

    table = score_table([row("full", 0.6, 10.0), row("full", 0.5, 80.0), row("snapkv", 0.75, 40.0)])
    assert "| t | 80.000 | 40.000 |" in format_table(table, 0.75, fmt="markdown")  # full from its lowest ratio
