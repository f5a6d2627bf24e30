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
    s[0, 0, 0] = 1.0  # chunk 0 third, the partial one
    idx, _ = Selection(chunk_size=5).kept_indices(s, 12)
    kept = idx[0, 0].tolist()
    assert len(kept) == 12
    assert set(range(10, 15)) | set(range(30, 35)) <= set(kept)
    assert set(kept) - set(range(10, 15)) - set(range(30, 35)) <= set(range(0, 5))
    assert 0 in kept  # inside the partial chunk, its best token goes first


def test_pyramid_budgets_fall_with_depth_and_keep_the_mean():
    sel = Selection(layer_budgets="pyramid", pyramid_beta=10)
    budgets = [sel.layer_kept(100, 1000, i, 8) for i in range(8)]
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > 100 > budgets[-1]
    assert abs(sum(budgets) / 8 - 100) <= 1


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
                                    dict(head_budgets="x"), dict(head_budgets="adaptive", chunk_size=4)])
def test_bad_selection(kwargs):
    with pytest.raises(ValueError):
        Selection(**kwargs)
