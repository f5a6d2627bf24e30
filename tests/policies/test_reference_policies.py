"""Baselines against plain re-derivations of their papers' rules (not against kvsieve's own code).

Every reference below is written from the paper (and, where the paper leaves a detail open, from the
authors' code, named in the reference's docstring) with loops and numpy in float64. It uses no
kvsieve scoring or selection code. kvsieve is driven through its public path: ``Signals`` built from
random tensors, ``policy.score``, ``policy.selection.layer_kept`` and ``policy.selection.kept_indices``
(with a GQA layout of 2 KV heads x 3 query heads, protected sinks / windows, ratios 0.25 .. 0.875),
and, for every policy, the real engine (``kvsieve.attach``) on a tiny random Llama whose reference is
computed from eager attention weights (``output_attentions=True``) and the model's own projections.

Scores are compared through the entries they keep. kvsieve computes in float32 and the references in
float64, so a swap between two entries whose reference scores agree to ``1e-5`` (relative) is a
numerical tie, reported as such, and accepted; any other difference fails.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.cache_utils import DynamicCache

import kvsieve
from kvsieve.engine.cache import sieve_layers
from kvsieve.policies import get
from kvsieve.query_stats import QueryStats
from kvsieve.signals import Signals

H, G, D = 2, 3, 8  # KV heads, query heads per KV head, head dim
N, W = 80, 8  # context length, observation window
LAYERS = 3
RATIOS = [0.25, 0.5, 0.75, 0.875]
RTOL = 1e-5


def budget_of(n: int, ratio: float) -> int:
    """Entries kept out of ``n`` at compression ``ratio`` (the fraction removed)."""
    return max(1, round(n * (1 - ratio)))


# --------------------------------------------------------------------------------------------------
# Plain references
# --------------------------------------------------------------------------------------------------


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def window_attention(keys: np.ndarray, queries: np.ndarray, scaling: float) -> np.ndarray:
    """(hq, w, n): softmax of each window query over its causal row (the window holds the last w entries)."""
    h, n, _ = keys.shape
    hq, w, _ = queries.shape
    out = np.zeros((hq, w, n))
    for qh in range(hq):
        kv = qh // (hq // h)
        for j in range(w):
            position = n - w + j
            out[qh, j, : position + 1] = softmax(scaling * keys[kv, : position + 1] @ queries[qh, j])
    return out


def avg_pool_zero_padded(row: np.ndarray, kernel: int) -> np.ndarray:
    """Mean over a centred window of ``kernel`` entries; missing neighbours count as zeros."""
    half = kernel // 2
    return np.array([sum(row[j] for j in range(i - half, i + half + 1) if 0 <= j < len(row)) / kernel
                     for i in range(len(row))])


def snapkv_scores_ref(window_att: np.ndarray, h: int, kernel: int = 5) -> np.ndarray:
    """SnapKV (arXiv:2404.14469, Alg. 1 and the authors' ``snapkv_utils.py``): attention summed over the
    window queries, pooled over the prefix only (``avg_pool1d`` on ``attn[..., :-window]``, zero padding
    counted), averaged over the query heads that share a KV head (authors' answer in SnapKV issue #22)."""
    hq, w, n = window_att.shape
    summed = window_att.sum(axis=1)  # (hq, n)
    pooled = summed.copy()
    for qh in range(hq):
        pooled[qh, : n - w] = avg_pool_zero_padded(summed[qh, : n - w], kernel)
    return pooled.reshape(h, hq // h, n).mean(axis=1)


def keep_top(scores: np.ndarray, kept: int, protected: set[int]) -> set[int]:
    """The protected entries, then the highest-scoring others until ``kept`` entries."""
    free = sorted((i for i in range(len(scores)) if i not in protected), key=lambda i: -scores[i])
    return set(protected) | set(free[: kept - len(protected)])


def rope_matrix(position: int, inv_freq: np.ndarray, attention_scaling: float, d: int) -> np.ndarray:
    """RoPE as transformers applies it: ``x cos + rotate_half(x) sin`` with ``rotate_half(x) = [-x2, x1]``."""
    r = np.eye(d)
    half = len(inv_freq)
    for i in range(half):
        c = math.cos(position * inv_freq[i]) * attention_scaling
        s = math.sin(position * inv_freq[i]) * attention_scaling
        r[i, i], r[i, i + half] = c, -s
        r[i + half, i], r[i + half, i + half] = s, c
    return r


def expected_attention_scores_ref(keys, values, pre_queries, inv_freq, attention_scaling, position, scaling,
                                  sink=4, epsilon=0.01, n_future=512) -> np.ndarray:
    """Expected Attention (arXiv:2510.00636; authors' reference: kvpress ``ExpectedAttentionPress``).

    Query mean and (population) covariance per head from the pre-RoPE queries at positions >= sink; the
    RoPE matrices of the next ``n_future`` positions averaged into ``R``; ``mu' = R mu``,
    ``Sigma' = R Sigma R^T``; logit ``s mu'.k + s^2 k^T Sigma' k / 2`` softmaxed over the non-sink
    entries; averaged over the group; ``(a + epsilon) ||v||``. Sinks get no score (they are kept).
    """
    h, n, d = keys.shape
    hq = pre_queries.shape[0]
    rotation = sum(rope_matrix(position + t, inv_freq, attention_scaling, d) for t in range(n_future)) / n_future
    attention = np.zeros((hq, n))
    for qh in range(hq):
        q = pre_queries[qh, sink:]
        mu = q.mean(axis=0)
        cov = (q - mu).T @ (q - mu) / len(q)
        mu, cov = rotation @ mu, rotation @ cov @ rotation.T
        k = keys[qh // (hq // h)]
        logits = np.array([scaling * mu @ k[i] + 0.5 * scaling**2 * k[i] @ cov @ k[i] for i in range(sink, n)])
        attention[qh, sink:] = softmax(logits)
    grouped = attention.reshape(h, hq // h, n).mean(axis=1)
    scores = (grouped + epsilon) * np.linalg.norm(values, axis=-1)
    scores[:, :sink] = np.nan  # never scored: protected
    return scores


def pyramid_budgets_ref(kept: int, window: int, num_layers: int, beta: float) -> list[float]:
    """PyramidKV (arXiv:2406.02069, Sec. 3): beyond the window, the top layer keeps ``c / beta`` and the
    bottom ``2c - c / beta`` of the mean ``c = kept - window``, linearly in between (exact, unrounded)."""
    c = kept - window
    top, bottom = c / beta, 2 * c - c / beta
    return [window + bottom + (top - bottom) * i / (num_layers - 1) for i in range(num_layers)]


def adakv_keep_ref(scores: np.ndarray, kept: int, window: int, alpha: float = 0.2) -> list[set[int]]:
    """AdaKV (arXiv:2407.11550, Alg. 1 + safeguard; as the authors ported it to kvpress, ``AdaKVPress``):
    the layer's ``h * kept`` entries go to the highest scores of any head, after each head has taken its
    own ``max(floor(alpha * kept), window)`` best (the window first)."""
    h, n = scores.shape
    floor = max(int(alpha * kept), window)
    window_set = set(range(n - window, n))
    chosen = [keep_top(scores[head], floor, window_set) for head in range(h)]
    pool = sorted(((head, i) for head in range(h) for i in range(n) if i not in chosen[head]),
                  key=lambda hi: -scores[hi])
    for head, i in pool[: h * kept - h * floor]:
        chosen[head].add(i)
    return chosen


def chunkkv_keep_ref(scores: np.ndarray, kept: int, window: int, chunk: int = 10) -> set[int]:
    """ChunkKV (arXiv:2502.00299, Alg. 1): the prefix cut into chunks of ``chunk`` from its first token,
    chunks ranked by their summed score, ``(kept - window) // chunk`` best whole chunks kept, plus the
    window. (kvsieve, like the lead's selection, never keeps the trailing partial chunk.)"""
    n = len(scores)
    n_chunks = (n - window) // chunk
    sums = [scores[c * chunk : (c + 1) * chunk].sum() for c in range(n_chunks)]
    best = sorted(range(n_chunks), key=lambda c: -sums[c])[: (kept - window) // chunk]
    return set(range(n - window, n)) | {i for c in best for i in range(c * chunk, (c + 1) * chunk)}


# --------------------------------------------------------------------------------------------------
# Comparison helpers
# --------------------------------------------------------------------------------------------------


def assert_same_keep(ref_scores: np.ndarray, expected: set[int], got: set[int], what: str) -> None:
    """Equal kept sets, or a swap between entries whose reference scores tie to RTOL."""
    if expected == got:
        return
    only_ref, only_got = expected - got, got - expected
    assert len(only_ref) == len(only_got), (what, sorted(only_ref), sorted(only_got))
    low = min(ref_scores[i] for i in only_ref)
    high = max(ref_scores[i] for i in only_got)
    assert abs(low - high) <= RTOL * max(abs(low), abs(high)), (what, sorted(only_ref), sorted(only_got), low, high)


def kvsieve_keeps(policy, signals: Signals, kept: int, seq_len: int) -> list[set[int]]:
    """Kept entries per KV head, through the policy's public path."""
    layer_kept = policy.selection.layer_kept(kept, seq_len, signals.layer_idx, signals.num_layers)
    scores = policy.score(signals)
    indices, valid = policy.selection.kept_indices(scores, layer_kept, signals.protected_tail)
    out = []
    for head in range(indices.shape[1]):
        row = indices[0, head] if valid is None else indices[0, head][valid[0, head]]
        assert len(set(row.tolist())) == len(row)  # no entry twice
        out.append(set(row.tolist()))
    return out


def random_inputs(seed: int, n: int = N, scale: tuple[float, ...] = (1.0,) * H):
    """Random keys, values, window queries, pre-RoPE queries and accumulated attention (float32)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, H, n, D, generator=g) * torch.tensor(scale).view(1, H, 1, 1) * 2
    values = torch.randn(1, H, n, D, generator=g)
    window_queries = torch.randn(1, H * G, W, D, generator=g) * 2
    pre_queries = torch.randn(1, H * G, n, D, generator=g) * 0.7 + torch.randn(1, H * G, 1, D, generator=g)
    accumulated = torch.rand(1, H, n, generator=g) * 5
    return keys, values, window_queries, pre_queries, accumulated


def signals_for(inputs, layer_idx: int = 1, inv_freq=None, attention_scaling: float = 1.0) -> Signals:
    keys, values, window_queries, pre_queries, accumulated = inputs
    n = keys.shape[2]
    if inv_freq is None:
        inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float) / D))
    return Signals(
        keys=keys, values=values, window_queries=window_queries,
        positions=torch.arange(n).expand(1, H, n), layer_idx=layer_idx, num_layers=LAYERS, scaling=D**-0.5,
        attention_received=accumulated, query_stats=QueryStats.from_queries(pre_queries),
        rope_inv_freq=inv_freq, rope_attention_scaling=attention_scaling, next_position=n,
    )


def np64(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


# --------------------------------------------------------------------------------------------------
# Signals-level tests: random tensors, every baseline, several ratios
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("seed", [0, 1])
def test_snapkv_family_scores_match_the_paper(ratio, seed):
    """SnapKV: window kept, the rest by pooled window attention, per KV head."""
    inputs = random_inputs(seed)
    signals = signals_for(inputs)
    kept = budget_of(N, ratio)
    scores = snapkv_scores_ref(window_attention(np64(inputs[0][0]), np64(inputs[2][0]), D**-0.5), H)
    got = kvsieve_keeps(get("snapkv", window=W), signals, kept, N)
    for head in range(H):
        expected = keep_top(scores[head], kept, set(range(N - W, N)))
        assert_same_keep(scores[head], expected, got[head], f"snapkv head {head}")


@pytest.mark.parametrize("ratio", RATIOS)
def test_pyramidkv_budgets_follow_the_paper_and_keep_the_mean(ratio):
    """Per-layer budgets: within one entry of the paper's linear schedule where it fits the context;
    the mean over layers is the uniform budget exactly; every budget within [window, context]."""
    for num_layers, n, beta in [(8, 4000, 20.0), (8, 400, 20.0), (32, 1000, 5.0), (LAYERS, N, 20.0)]:
        kept = budget_of(n, ratio)
        selection = get("pyramidkv", window=W, beta=beta).selection
        budgets = [selection.layer_kept(kept, n, i, num_layers) for i in range(num_layers)]
        assert sum(budgets) == kept * num_layers, (num_layers, n, budgets)
        assert all(W <= b <= n for b in budgets), budgets
        assert budgets == sorted(budgets, reverse=True)
        paper = pyramid_budgets_ref(kept, W, num_layers, beta)
        if paper[0] <= n:  # the paper's schedule fits this context: it is what kvsieve uses
            assert all(abs(b - p) < 1 for b, p in zip(budgets, paper)), (budgets, paper)
            if kept - W >= beta:  # the schedule really falls (top below the mean)
                assert budgets[0] > kept > budgets[-1]


@pytest.mark.parametrize("ratio", RATIOS)
def test_pyramidkv_keeps_the_top_pooled_scores_within_each_layer_budget(ratio):
    inputs = random_inputs(2)
    kept = budget_of(N, ratio)
    policy = get("pyramidkv", window=W)
    scores = snapkv_scores_ref(window_attention(np64(inputs[0][0]), np64(inputs[2][0]), D**-0.5), H)
    for layer in range(LAYERS):
        signals = signals_for(inputs, layer_idx=layer)
        layer_budget = policy.selection.layer_kept(kept, N, layer, LAYERS)
        got = kvsieve_keeps(policy, signals, kept, N)
        for head in range(H):
            assert len(got[head]) == layer_budget
            expected = keep_top(scores[head], layer_budget, set(range(N - W, N)))
            assert_same_keep(scores[head], expected, got[head], f"pyramidkv layer {layer} head {head}")


@pytest.mark.parametrize("ratio", RATIOS)
def test_adakv_shares_the_layer_budget_across_heads_with_a_floor(ratio):
    inputs = random_inputs(3, scale=(3.0, 0.3))  # a peaked head and a flat one: their budgets must differ
    signals = signals_for(inputs)
    kept = budget_of(N, ratio)
    scores = snapkv_scores_ref(window_attention(np64(inputs[0][0]), np64(inputs[2][0]), D**-0.5), H)
    expected = adakv_keep_ref(scores, kept, W)
    got = kvsieve_keeps(get("adakv", window=W), signals, kept, N)
    counts = [len(s) for s in got]
    assert sum(counts) == H * kept  # the layer's budget, no more, no less
    assert all(c >= max(int(0.2 * kept), W) for c in counts)
    assert got == expected, ([sorted(s) for s in got], [sorted(s) for s in expected])
    if kept > W:  # beyond the window the heads compete; with these heads they end up with different budgets
        assert len(set(counts)) > 1, counts


@pytest.mark.parametrize("ratio", RATIOS)
def test_chunkkv_keeps_whole_chunks_of_ten_ranked_by_head_averaged_scores(ratio):
    inputs = random_inputs(4)
    signals = signals_for(inputs)
    kept = budget_of(N, ratio)
    scores = snapkv_scores_ref(window_attention(np64(inputs[0][0]), np64(inputs[2][0]), D**-0.5), H).mean(axis=0)
    expected = chunkkv_keep_ref(scores, kept, W)
    got = kvsieve_keeps(get("chunkkv", window=W), signals, kept, N)
    assert all(g == expected for g in got), ([sorted(g) for g in got], sorted(expected))
    assert len(expected) == W + (kept - W) // 10 * 10


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("seed", [5, 6])
def test_tova_keeps_the_top_head_averaged_attention_of_the_last_query(ratio, seed):
    """TOVA: the last query's attention averaged over all heads of the layer; nothing protected."""
    inputs = random_inputs(seed)
    signals = signals_for(inputs)
    kept = budget_of(N, ratio)
    keys, queries = np64(inputs[0][0]), np64(inputs[2][0])
    last = np.array([softmax(D**-0.5 * keys[qh // G] @ queries[qh, -1]) for qh in range(H * G)]).mean(axis=0)
    expected = keep_top(last, kept, set())
    for head, got in enumerate(kvsieve_keeps(get("tova", window=W), signals, kept, N)):
        assert_same_keep(last, expected, got, f"tova head {head}")


@pytest.mark.parametrize("ratio", RATIOS)
def test_h2o_splits_the_budget_between_heavy_hitters_and_recent_tokens(ratio):
    inputs = random_inputs(7)
    signals = signals_for(inputs)
    kept = budget_of(N, ratio)
    assert kept % 2 == 0  # an even budget: the paper's even split is unambiguous
    accumulated = np64(inputs[4][0])
    recent = set(range(N - kept // 2, N))
    for head, got in enumerate(kvsieve_keeps(get("h2o"), signals, kept, N)):
        assert_same_keep(accumulated[head], keep_top(accumulated[head], kept, recent), got, f"h2o head {head}")


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("attention_scaling", [1.0, 1.3])
def test_expected_attention_matches_the_paper(ratio, attention_scaling):
    inputs = random_inputs(8)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float) / D))
    signals = signals_for(inputs, inv_freq=inv_freq, attention_scaling=attention_scaling)
    kept = budget_of(N, ratio)
    scores = expected_attention_scores_ref(np64(inputs[0][0]), np64(inputs[1][0]), np64(inputs[3][0]),
                                           np64(inv_freq), attention_scaling, N, D**-0.5)
    for head, got in enumerate(kvsieve_keeps(get("expected_attention"), signals, kept, N)):
        assert_same_keep(scores[head], keep_top(scores[head], kept, set(range(4))), got, f"EA head {head}")


def test_reference_rope_is_the_one_transformers_applies():
    """The reference's rotation matrices rotate as transformers' ``apply_rotary_pos_emb`` does."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    x = torch.randn(1, 1, 5, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(100, 105, dtype=torch.float64)
    freqs = torch.cat([positions[:, None] * inv_freq[None]] * 2, dim=-1)
    rotated, _ = apply_rotary_pos_emb(x, x, freqs.cos()[None] * 1.3, freqs.sin()[None] * 1.3)
    for t in range(5):
        expected = rope_matrix(100 + t, inv_freq.numpy(), 1.3, D) @ x[0, 0, t].numpy()
        np.testing.assert_allclose(rotated[0, 0, t].numpy(), expected, atol=1e-12)


@pytest.mark.parametrize("ratio", RATIOS)
def test_streaming_llm_keeps_the_sinks_and_the_most_recent(ratio):
    inputs = random_inputs(9)
    kept = budget_of(N, ratio)
    expected = set(range(4)) | set(range(N - (kept - 4), N))
    assert kvsieve_keeps(get("streaming_llm"), signals_for(inputs), kept, N) == [expected] * H


@pytest.mark.parametrize("ratio", RATIOS)
def test_knorm_keeps_the_lowest_key_norms(ratio):
    inputs = random_inputs(10)
    kept = budget_of(N, ratio)
    norms = np.linalg.norm(np64(inputs[0][0]), axis=-1)
    for head, got in enumerate(kvsieve_keeps(get("knorm"), signals_for(inputs), kept, N)):
        assert_same_keep(-norms[head], keep_top(-norms[head], kept, set()), got, f"knorm head {head}")


@pytest.mark.parametrize("ratio", RATIOS)
def test_random_keeps_a_seeded_uniform_subset(ratio):
    """No paper: uniform scores from a generator seeded by (seed, layer), so runs repeat."""
    inputs = random_inputs(11)
    kept = budget_of(N, ratio)
    for layer in range(LAYERS):
        uniform = torch.rand(1, H, N, generator=torch.Generator().manual_seed(3 * 100_003 + layer))[0].numpy()
        got = kvsieve_keeps(get("random", seed=3), signals_for(inputs, layer_idx=layer), kept, N)
        assert got == [keep_top(uniform[head], kept, set()) for head in range(H)]
    # over many seeds every entry is about as likely to be kept
    counts = np.zeros(N)
    for seed in range(200):
        for s in kvsieve_keeps(get("random", seed=seed), signals_for(inputs), kept, N):
            counts[list(s)] += 1
    share = counts / (200 * H)
    assert abs(share.mean() - kept / N) < 1e-9 and np.abs(share - kept / N).max() < 0.15


# --------------------------------------------------------------------------------------------------
# The whole path: kvsieve.attach on a tiny random GQA Llama vs references from eager attention
# --------------------------------------------------------------------------------------------------

ENGINE_N = 80


@pytest.fixture(scope="module")
def gqa_llama():
    config = LlamaConfig(vocab_size=128, hidden_size=48, intermediate_size=96, num_hidden_layers=LAYERS,
                         num_attention_heads=H * G, num_key_value_heads=H, head_dim=D,
                         max_position_embeddings=512, eos_token_id=None, bos_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def eager(gqa_llama):
    """One plain forward (no kvsieve): eager attention weights, cached keys/values, pre-RoPE queries."""
    ids = torch.randint(1, 128, (1, ENGINE_N), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = DynamicCache(config=gqa_llama.config)
        out = gqa_llama(input_ids=ids, cache=cache, use_cache=True, output_attentions=True, output_hidden_states=True)
        layers = []
        for i, block in enumerate(gqa_llama.model.layers):
            normed = block.input_layernorm(out.hidden_states[i])
            pre_q = block.self_attn.q_proj(normed).view(1, ENGINE_N, H * G, D).transpose(1, 2)
            layers.append(dict(attention=np64(out.attentions[i][0]), keys=np64(cache.layers[i].keys[0]),
                               values=np64(cache.layers[i].values[0]), pre_queries=np64(pre_q[0])))
    rotary = gqa_llama.model.rotary_emb
    return dict(ids=ids, layers=layers, inv_freq=np64(rotary.inv_freq), attention_scaling=rotary.attention_scaling,
                scaling=gqa_llama.model.layers[0].self_attn.scaling)


def engine_keeps(model, ids, policy, ratio) -> list[list[set[int]]]:
    """Kept positions per layer and KV head after a compressed prefill (valid entries only)."""
    with torch.no_grad(), kvsieve.attach(model, policy, ratio=ratio) as session:
        model(input_ids=ids, use_cache=True)
    out = []
    for _, layer in sieve_layers(session.cache):
        heads = []
        for head in range(H):
            row = layer.positions[0, head]
            if layer.valid is not None:
                row = row[layer.valid[0, head]]
            heads.append(set(row.tolist()))
        out.append(heads)
    return out


def test_reference_attention_is_the_model_attention(eager):
    """Sanity of the reference pipeline: pre-RoPE queries, rotated, against the cached keys give the
    eager attention weights of the last row."""
    layer = eager["layers"][1]
    rotation = rope_matrix(ENGINE_N - 1, eager["inv_freq"], eager["attention_scaling"], D)
    for qh in range(H * G):
        q = rotation @ layer["pre_queries"][qh, -1]
        row = softmax(eager["scaling"] * layer["keys"][qh // G] @ q)
        np.testing.assert_allclose(row, layer["attention"][qh, -1], atol=1e-5)


def engine_case(eager, name, ratio):
    n, kept = ENGINE_N, budget_of(ENGINE_N, ratio)
    for idx, layer in enumerate(eager["layers"]):
        att = layer["attention"]  # (hq, n, n), rows = queries
        window = att[:, n - W :, :]
        if name in ("snapkv", "pyramidkv", "adakv", "chunkkv"):
            scores = snapkv_scores_ref(window, H)
        elif name == "tova":
            scores = np.repeat(att[:, -1, :].mean(axis=0)[None], H, axis=0)
        elif name == "h2o":
            scores = att.sum(axis=1).reshape(H, G, n).sum(axis=1)
        elif name == "knorm":
            scores = -np.linalg.norm(layer["keys"], axis=-1)
        elif name == "expected_attention":
            scores = expected_attention_scores_ref(layer["keys"], layer["values"], layer["pre_queries"],
                                                   eager["inv_freq"], eager["attention_scaling"], n, eager["scaling"])
        elif name == "streaming_llm":
            scores = np.repeat(np.arange(n, dtype=float)[None], H, axis=0)
        elif name == "random":
            scores = torch.rand(1, H, n, generator=torch.Generator().manual_seed(idx))[0].double().numpy()
        yield idx, scores, kept


ENGINE_POLICIES = ["snapkv", "pyramidkv", "adakv", "chunkkv", "tova", "h2o", "knorm", "expected_attention",
                   "streaming_llm", "random"]


@pytest.mark.parametrize("ratio", [0.5, 0.875])
@pytest.mark.parametrize("name", ENGINE_POLICIES)
def test_engine_keeps_what_the_paper_keeps(gqa_llama, eager, name, ratio):
    policy = get(name, window=W)
    got = engine_keeps(gqa_llama, eager["ids"], policy, ratio)
    window = set(range(ENGINE_N - W, ENGINE_N))
    for (idx, scores, kept), layer_got in zip(engine_case(eager, name, ratio), got):
        if name == "adakv":
            expected = adakv_keep_ref(scores, kept, W)
            assert sum(len(s) for s in layer_got) == H * kept
            assert layer_got == expected, (idx, [sorted(s) for s in layer_got], [sorted(s) for s in expected])
            continue
        if name == "chunkkv":
            expected = chunkkv_keep_ref(scores.mean(axis=0), kept, W)
            assert layer_got == [expected] * H, (idx, [sorted(s) for s in layer_got], sorted(expected))
            continue
        budget = kept
        if name == "pyramidkv":
            budget = policy.selection.layer_kept(kept, ENGINE_N, idx, LAYERS)
            assert abs(budget - pyramid_budgets_ref(kept, W, LAYERS, 20.0)[idx]) < 1 \
                or pyramid_budgets_ref(kept, W, LAYERS, 20.0)[0] > ENGINE_N
        protected = {"snapkv": window, "pyramidkv": window, "h2o": set(range(ENGINE_N - kept // 2, ENGINE_N)),
                     "expected_attention": set(range(4)), "streaming_llm": set(range(4))}.get(name, set())
        for head in range(H):
            expected = keep_top(scores[head], budget, protected)
            assert_same_keep(scores[head], expected, layer_got[head], f"{name} layer {idx} head {head}")


def test_engine_adakv_heads_really_differ(gqa_llama, eager):
    """Not vacuous: on this model AdaKV gives the two KV heads of some layer different budgets."""
    got = engine_keeps(gqa_llama, eager["ids"], get("adakv", window=W), 0.5)
    assert any(len(layer[0]) != len(layer[1]) for layer in got), [[len(h) for h in layer] for layer in got]


# --------------------------------------------------------------------------------------------------
# Expected Attention's input: the pre-RoPE query statistics the engine collects
# --------------------------------------------------------------------------------------------------


def model_pre_rope_queries(model, ids) -> list[np.ndarray]:
    """(hq, n, d) queries before RoPE per layer, from the model's own modules (after q_norm where it has one)."""
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
        queries = []
        for i, block in enumerate(model.model.layers):
            attention = block.self_attn
            q = attention.q_proj(block.input_layernorm(out.hidden_states[i]))
            q = q.view(*q.shape[:2], -1, attention.head_dim)
            if hasattr(attention, "q_norm"):
                q = attention.q_norm(q)
            queries.append(np64(q[0].transpose(0, 1)))
    return queries


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_query_stats_are_the_moments_of_the_model_queries(arch):
    """Mean and population covariance of the queries at positions >= sink, per head, as the model
    computes them before RoPE (Qwen3 and Gemma3: after their q_norm); in decode mode (chunks of 16, the cache
    pruned between them) too, on the first layer, whose queries do not depend on the pruning."""
    from conftest import tiny_model

    model = tiny_model(arch)
    ids = torch.randint(1, 128, (1, 90), generator=torch.Generator().manual_seed(2))
    reference = model_pre_rope_queries(model, ids)
    for mode, options in [("prefill", {}), ("decode", dict(chunk_size=16))]:
        with torch.no_grad(), kvsieve.attach(model, get("expected_attention", window=8), kept=60, mode=mode,
                                             **options) as session:
            model(input_ids=ids, use_cache=True)
        layers = sieve_layers(session.cache)
        assert layers and all(layer.query_stats.total == 90 for _, layer in layers)
        for idx, layer in layers:
            if mode == "decode" and idx > 0:  # later layers read a pruned cache: other queries than one prefill
                continue
            for skip in (0, 4, 64):
                mean, cov = layer.query_stats.moments(skip)
                q = reference[idx][:, skip:]
                expected_mean = q.mean(axis=1)
                expected_cov = np.stack([(x - m).T @ (x - m) / len(x) for x, m in zip(q, expected_mean)])
                np.testing.assert_allclose(np64(mean[0]), expected_mean, atol=1e-4, rtol=1e-4)
                np.testing.assert_allclose(np64(cov[0]), expected_cov, atol=1e-4, rtol=1e-4)
            inv_freq, scaling = layer.rope
            rotary = model.model.rotary_emb
            assert torch.equal(inv_freq, getattr(rotary, "inv_freq", None) if hasattr(rotary, "inv_freq")
                               else rotary.full_attention_inv_freq)


def test_query_stats_hooks_are_removed_even_on_error(llama, prompt_ids):
    def hooks():
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in llama.modules())

    before = hooks()
    with pytest.raises(RuntimeError, match="boom"):
        with kvsieve.attach(llama, get("expected_attention", window=16), ratio=0.5):
            assert hooks() > before
            llama(input_ids=prompt_ids, use_cache=True)
            raise RuntimeError("boom")
    assert hooks() == before
    assert not any("_kvsieve_query_layer" in m.__dict__ for m in llama.modules())
    with kvsieve.attach(llama, get("snapkv", window=16), ratio=0.5) as session:  # not asked: none collected
        assert hooks() == before
        llama(input_ids=prompt_ids, use_cache=True)
    assert all(layer.query_stats is None for _, layer in sieve_layers(session.cache))


def test_query_stats_pieces_add_up_and_rows_select():
    """Statistics fed in pieces (across the first positions kept one by one) equal one pass; batch rows select."""
    g = torch.Generator().manual_seed(0)
    queries = torch.randn(3, 2, 150, 4, generator=g) * 3 + 10  # an offset mean: no cancellation allowed
    whole = QueryStats.from_queries(queries)
    pieces = QueryStats.from_queries(queries[:, :, :7])
    for start, stop in [(7, 60), (60, 61), (61, 150)]:
        pieces = pieces.add(queries[:, :, start:stop], start)
    for skip in (0, 4, 64):
        q = queries[:, :, skip:].double()
        mean = q.mean(dim=2)
        cov = (q - mean[:, :, None]).transpose(-1, -2) @ (q - mean[:, :, None]) / q.shape[2]
        for stats in (whole, pieces):
            got_mean, got_cov = stats.moments(skip)
            torch.testing.assert_close(got_mean.double(), mean, atol=1e-4, rtol=1e-5)
            torch.testing.assert_close(got_cov.double(), cov, atol=1e-3, rtol=1e-4)
    row = whole[torch.tensor([1])].moments(4)
    torch.testing.assert_close(row[0], whole.moments(4)[0][1:2])
    with pytest.raises(ValueError, match="start at position"):
        whole.add(queries[:, :, :1], 10)
