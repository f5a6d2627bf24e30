import math

import pytest
import torch

from kvsieve.selection import Budget, Selection


def scores(b=1, h=2, n=50, seed=0):
    return torch.randn(b, h, n, generator=torch.Generator().manual_seed(seed))


def test_topk_per_head_are_the_highest_scores():
    s = scores()
    idx, valid = Selection().kept_indices(s, 10)
    assert valid is None and idx.shape == (1, 2, 10)
    for head in range(2):
        assert set(idx[0, head].tolist()) == set(s[0, head].topk(10).indices.tolist())
        assert idx[0, head].tolist() == sorted(idx[0, head].tolist())


def test_sink_and_recent_are_kept_even_with_lowest_scores():
    s = scores()
    s[..., :3] = -100.0
    s[..., -5:] = -100.0
    idx, _ = Selection(sink=3, recent=5).kept_indices(s, 12)
    for head in range(2):
        kept = set(idx[0, head].tolist())
        assert {0, 1, 2, 45, 46, 47, 48, 49} <= kept
        rest = kept - {0, 1, 2, 45, 46, 47, 48, 49}
        free = s[0, head, 3:45]
        assert rest == {i + 3 for i in free.topk(4).indices.tolist()}


def test_protected_tail_counts_with_recent():
    idx, _ = Selection(recent=4).kept_indices(scores(), 10, protected_tail=6)
    assert set(range(44, 50)) <= set(idx[0, 0].tolist())


def test_protection_above_budget_is_an_error():
    with pytest.raises(ValueError, match="protected"):
        Selection(sink=8, recent=8).kept_indices(scores(), 10)


def test_chunks_are_kept_whole_and_best_first():
    s = torch.zeros(1, 1, 40)
    s[0, 0, 10:15] = 5.0  # chunk 2 best
    s[0, 0, 30:35] = 3.0  # chunk 6 second
    s[0, 0, 0] = 1.0  # chunk 0 third
    idx, _ = Selection(chunk_size=5).kept_indices(s, 12)
    # whole chunks only: 12 // 5 = 2 chunks, the remaining 2 slots stay unused
    assert idx[0, 0].tolist() == list(range(10, 15)) + list(range(30, 35))


def test_chunk_grid_starts_after_the_sinks_and_skips_protected_entries():
    s = torch.arange(30, dtype=torch.float).flip(0)[None, None]  # earlier entries score higher
    idx, _ = Selection(sink=2, recent=3, chunk_size=4).kept_indices(s, 14)
    # free entries 2..26 hold 6 whole chunks (2-5, 6-9, ..., 22-25); (14 - 5) // 4 = 2 are kept: the first two
    assert idx[0, 0].tolist() == [0, 1] + list(range(2, 10)) + [27, 28, 29]


def test_recent_share_protects_that_part_of_the_budget():
    s = scores(n=40)
    s[..., -20:] = -100.0  # recent entries score lowest
    idx, _ = Selection(recent_share=0.5).kept_indices(s, 10)
    for head in range(2):
        kept = idx[0, head].tolist()
        assert kept[-5:] == list(range(35, 40))  # half the budget: the 5 most recent
        assert set(kept[:5]) == set(s[0, head, :35].topk(5).indices.tolist())


def _pyramid_reference(kept: int, n: int, layers: int, window: int, beta: float) -> list[float]:
    """PyramidKV (arXiv:2406.02069, Sec. 3.2): window + an arithmetic sequence of the non-window budget
    from 2c - c/beta (bottom) to c/beta (top), c = kept - window; a bottom above the context is clamped
    and the top raised to keep the total; uniform when the top would fall below the window."""
    c = kept - window
    bottom, top = 2 * c - c / beta, c / beta
    if window + bottom > n:
        bottom = n - window
        top = 2 * c - bottom
    if c <= 0 or top < 0:
        return [float(min(kept, n))] * layers
    return [window + bottom - (bottom - top) * i / (layers - 1) for i in range(layers)]


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75, 0.875])
@pytest.mark.parametrize("n", [300, 1000, 4050])
def test_pyramid_budgets_keep_the_mean_and_stay_within_window_and_context(ratio, n):
    window, layers, beta = 64, 24, 20.0
    sel = Selection(recent=window, layer_budgets="pyramid", pyramid_beta=beta)
    kept = round(n * (1 - ratio))
    budgets = [sel.layer_kept(kept, n, i, layers) for i in range(layers)]
    assert sum(budgets) == kept * layers  # the mean is the uniform budget exactly
    assert all(min(kept, window) <= b <= n for b in budgets)
    assert budgets == sorted(budgets, reverse=True)
    reference = _pyramid_reference(kept, n, layers, window, beta)
    assert all(abs(b - r) <= 1 for b, r in zip(budgets, reference))
    if kept > window:
        assert min(budgets) > window  # the top layers keep context beyond the window


def test_pyramid_falls_back_to_uniform_when_the_window_takes_the_budget():
    sel = Selection(recent=64, layer_budgets="pyramid")
    assert sel.layer_budgets_for(60, 1000, 8) == [60] * 8
    assert sel.layer_budgets_for(100, None, 4)[0] > 100  # unbounded context (decode mode): no clamp


def test_adaptive_heads_share_the_layer_budget_with_a_floor():
    s = scores(h=4, n=60)
    s[0, 0] += 10  # head 0 has the highest scores
    idx, valid = Selection(head_budgets="adaptive", adaptive_floor=0.25).kept_indices(s, 10)
    per_head = valid.sum(-1)[0]
    assert int(per_head.sum()) == 40
    assert int(per_head.min()) >= 2 and int(per_head[0]) > 10
    assert idx.shape[-1] == int(per_head.max())


@pytest.mark.parametrize("ratio,n,expected", [(0.0, 100, 100), (0.5, 100, 50), (0.875, 4096, 512), (0.99, 10, 1)])
def test_budget_resolves_ratio(ratio, n, expected):
    assert Budget(ratio=ratio).resolve(n) == expected


@pytest.mark.parametrize("kwargs,error", [
    (dict(ratio=1.0), ValueError), (dict(ratio=-0.1), ValueError), (dict(ratio=math.nan), ValueError),
    (dict(ratio="0.5"), TypeError), (dict(kept=0), ValueError), (dict(kept=2.5), TypeError),
    (dict(ratio=0.5, kept=3), ValueError), (dict(), ValueError),
])
def test_bad_budgets_name_the_value(kwargs, error):
    with pytest.raises(error):
        Budget(**kwargs)


def test_budget_above_context_and_empty_context():
    with pytest.raises(ValueError, match="above the context length 10"):
        Budget(kept=11).resolve(10)
    with pytest.raises(ValueError, match="empty"):
        Budget(ratio=0.5).resolve(0)


@pytest.mark.parametrize("kwargs", [dict(sink=-1), dict(chunk_size=0), dict(layer_budgets="cone"),
                                    dict(head_budgets="x"), dict(head_budgets="adaptive", chunk_size=4),
                                    dict(recent_share=1.0), dict(recent_share=-0.1)])
def test_bad_selection(kwargs):
    with pytest.raises(ValueError):
        Selection(**kwargs)


def _reference_allocation(layers, budgets, sink, floor_share):
    """Plain Python: every head keeps its sinks and its best entries up to its floor, then the rest of the
    total goes to the best remaining entries of any head, ties to the earlier layer, head, entry."""
    b, h = len(layers[0]), len(layers[0][0])
    kept = [[[set() for _ in range(h)] for _ in range(b)] for _ in layers]
    for row in range(b):
        pool = []
        for li, (layer, budget) in enumerate(zip(layers, budgets)):
            floor = max(int(floor_share * budget), sink, 1)
            for head in range(h):
                values = layer[row][head]
                order = list(range(sink)) + sorted(range(sink, len(values)), key=lambda i: (-values[i], i))
                kept[li][row][head].update(order[:floor])
                pool += [(-values[i], li, head, i) for i in order[floor:]]
        remaining = h * sum(budgets) - sum(len(kept[li][row][head]) for li in range(len(layers)) for head in range(h))
        for _, li, head, i in sorted(pool)[:remaining]:
            kept[li][row][head].add(i)
    return kept


@pytest.mark.parametrize("seed", range(4))
def test_global_allocation_matches_a_plain_python_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    lengths, budgets = [40, 23, 31], [9, 6, 12]
    # integer scores: many ties, which must go to the earlier layer, head and entry
    layers = [torch.randint(0, 6, (2, 3, n), generator=gen).double() for n in lengths]
    sel = Selection(sink=2, allocation="global", adaptive_floor=0.25)
    picked = sel.allocate(layers, budgets)
    expected = _reference_allocation([x.tolist() for x in layers], budgets, sink=2, floor_share=0.25)
    for li, (indices, valid) in enumerate(picked):
        assert indices.shape[-1] == max(len(s) for row in expected[li] for s in row)
        assert bool((indices.diff(dim=-1) > 0).all())  # ascending, distinct
        for row in range(2):
            for head in range(3):
                mine = indices[row, head] if valid is None else indices[row, head][valid[row, head]]
                assert set(mine.tolist()) == expected[li][row][head], (li, row, head)


@pytest.mark.parametrize("normalization", ["none", "zscore"])
def test_entries_scored_minus_infinity_are_never_kept_and_plus_infinity_always(normalization):
    s = scores(h=3, n=40)
    s[0, 0, 10:] = float("-inf")  # head 0 holds 10 real entries, the rest padding
    s[0, 1, 5] = float("inf")
    s[0, 2, 7] = float("nan")
    sel = Selection(allocation="layer", normalization=normalization)
    idx, valid = sel.kept_indices(s, 16)
    kept = [set(idx[0, head][valid[0, head]].tolist()) for head in range(3)]
    assert sum(map(len, kept)) == 48
    assert kept[0] <= set(range(10)) and 5 in kept[1] and 7 not in kept[2]
    # a budget above the keepable entries keeps all of them and nothing else
    idx, valid = sel.kept_indices(s, 32)
    kept = [set(idx[0, head][valid[0, head]].tolist()) for head in range(3)]
    assert kept == [set(range(10)), set(range(40)), set(range(40)) - {7}]
