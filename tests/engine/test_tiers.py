"""Two tiers and recall: what a policy evicts is kept cold and a question brings back the chunks it attends to most,
checked against a from-scratch computation (plain transformers, numpy), bytes against counts by hand, and the
compressed context bit for bit unchanged after a question."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import COMMON, header_ids, sharpened, tiny_model
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvsieve.engine.attach import attach
from kvsieve.engine.cache import cache_bytes, sieve_layers
from kvsieve.engine.cold import ColdLayer, dequantize, group_size, quantize
from kvsieve.engine.reader import Capture, read_prompt
from kvsieve.engine.tiers import KeySketch
from kvsieve.policies import get
from kvsieve.policy import FullCache
from kvsieve.recall import Recall


def _one_layer():
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{**COMMON, "num_hidden_layers": 1}),
                                             attn_implementation="sdpa").eval()
    return sharpened(model)


def _held(layer) -> list[set[int]]:
    """Per KV head (row 0), the positions a layer holds."""
    positions, valid = layer.positions[0], layer.valid
    valid = torch.ones_like(positions, dtype=torch.bool) if valid is None else valid[0]
    return [set(positions[h][valid[h]].tolist()) for h in range(positions.shape[0])]


def _tiers(model, ids, ratio=0.75, **recall):
    policy = get("knorm")
    read = read_prompt(model, ids, Capture.of([policy]))
    return read.tiered(policy, ratio, Recall(**recall))


@pytest.mark.parametrize(("pool", "heads", "fraction"), [("chunk", "own", 0.1), ("span", "own", 0.1),
                                                       ("span", "shared", 0.1), ("chunk", "shared", 0.2)])
@torch.no_grad()
def test_a_question_recalls_the_chunks_its_own_queries_attend_to_most(pool, heads, fraction):
    """One layer, so the question's queries are the model's from scratch: q_proj of the normed embeddings, rotated
    at the question's positions; the cold keys are a plain transformers prefill's. In plain Python: each evicted
    entry's best q . k over its group's queries, pooled (its chunk's best, or the best in its span), the top entries
    by pooled score then position."""
    model = _one_layer()
    ids, question = header_ids(3, 120), torch.randint(32, 127, (1, 6), generator=torch.Generator().manual_seed(4))
    n, m, chunk = ids.shape[1], question.shape[1], 4
    tiers = _tiers(model, ids, fraction=fraction, chunk=chunk, pool=pool, heads=heads)
    hot = _held(sieve_layers(tiers.hot)[0][1])
    cache = tiers.question_cache()
    with attach(model, FullCache()):
        model(input_ids=question, cache=cache, use_cache=True)
    got = [held - hot[h] - set(range(n, n + m)) for h, held in enumerate(_held(sieve_layers(cache)[0][1]))]

    # from scratch: the full keys, and the question's queries at layer 0
    full = DynamicCache(config=model.config)
    model(input_ids=ids, cache=full, use_cache=True)
    keys = full.layers[0].keys[0].float().numpy()  # (h, n, d), rotated
    captured = []
    attention = model.model.layers[0].self_attn
    handle = attention.q_proj.register_forward_hook(lambda _m, _a, out: captured.append(out))
    model(input_ids=question, cache=full, use_cache=True)
    handle.remove()
    d = attention.head_dim
    q = captured[0].view(1, m, -1, d).transpose(1, 2)
    positions = torch.arange(n, n + m)[None]
    cos, sin = model.model.rotary_emb(q, positions)
    q, _ = apply_rotary_pos_emb(q, q, cos, sin)
    q = q[0].float().numpy()  # (hq, m, d)
    kv_heads, group = keys.shape[0], q.shape[0] // keys.shape[0]
    recall = int(round(fraction * n))
    best = []
    for h in range(kv_heads):
        cold = sorted(set(range(n)) - hot[h])
        scores = (q[h * group:(h + 1) * group].reshape(-1, d) @ keys[h, cold].T).max(0)
        score_at = dict(zip(cold, scores))
        if pool == "chunk":  # an aligned chunk's best entry
            best.append({p: max(s for q, s in score_at.items() if q // chunk == p // chunk) for p in cold})
        else:  # the best entry from chunk positions before to chunk // 4 after
            best.append({p: max(s for q, s in score_at.items() if p - chunk <= q <= p + chunk // 4) for p in cold})
    for h in range(kv_heads):
        if heads == "shared":  # a position's best over the heads where it is cold
            rank = {p: max(b[p] for b in best if p in b) for p in best[h]}
        else:
            rank = best[h]
        ranked = sorted(rank, key=lambda p: (-rank[p], p))
        assert got[h] == set(ranked[:recall]), h
    assert tiers.recalled == kv_heads * recall
    assert tiers.moved_bytes == kv_heads * recall * 2 * d * 4  # exact float32 keys and values


@torch.no_grad()
def test_the_compressed_context_is_unchanged_after_a_question():
    model = tiny_model("llama", seed=2)
    tiers = _tiers(model, header_ids(5, 150), fraction=0.1, chunk=8, sketch="sign", cold="int8")
    before = [(layer.keys.clone(), layer.values.clone(), layer.positions.clone()) for _, layer in
              sieve_layers(tiers.hot)]
    cold_before = {i: (c.keys().clone(), c.positions.clone()) for i, c in tiers.cold.items()}
    for seed in (1, 2):
        cache = tiers.question_cache()
        with attach(model, FullCache()):
            out = model(input_ids=header_ids(seed, 5)[:, -5:], cache=cache, use_cache=True)
            model(input_ids=out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
        assert tiers.recalled > 0
    for (k, v, p), (_, layer) in zip(before, sieve_layers(tiers.hot), strict=True):
        assert torch.equal(k, layer.keys) and torch.equal(v, layer.values) and torch.equal(p, layer.positions)
    for i, cold in tiers.cold.items():
        assert torch.equal(cold.keys(), cold_before[i][0]) and torch.equal(cold.positions, cold_before[i][1])


@pytest.mark.parametrize("cold", ["exact", "int8", "int4", "disk"])
@torch.no_grad()
def test_hot_and_cold_bytes_against_counts_by_hand(cold, tmp_path):
    model = tiny_model("llama", seed=2)
    n = header_ids(6, 200).shape[1]
    tiers = _tiers(model, header_ids(6, 200), ratio=0.75, fraction=0.05, sketch="sign", cold=cold)
    cfg = model.config
    layers, heads, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    kept = sum(len(s) for _, layer in sieve_layers(tiers.hot) for s in _held(layer))
    evicted = layers * heads * n - kept
    groups = d // group_size(d)
    per_entry = {"exact": 2 * d * 4, "disk": 2 * d * 4, "int8": 2 * (d + 2 * groups), "int4": 2 * (d // 2 + 2 * groups)}
    assert tiers.cold_nbytes() == evicted * per_entry[cold]
    assert tiers.cold_resident_nbytes() == (0 if cold == "disk" else evicted * per_entry[cold])
    assert cache_bytes(tiers.hot) == kept * 2 * d * 4
    width = {i: c.positions.shape[-1] for i, c in tiers.cold.items()}  # sketches are padded to the widest head
    assert tiers.hot_nbytes() == kept * 2 * d * 4 + sum(heads * w * (d // 8 + 2) for w in width.values())
    # the point keeps 25%: the policy's share, the recall's and the sketches' fit it
    s = (d / 8 + 2) / (2 * d * 4)
    assert kept / (layers * heads * n) == pytest.approx((0.25 - 0.05 - s) / (1 - s), abs=1 / n)


def test_quantized_entries_are_within_half_a_step_of_the_original():
    x = torch.randn(2, 3, 10, 64) * torch.logspace(-3, 2, 64)
    for bits, levels in (("int8", 127), ("int4", 7)):
        codes, scale = quantize(x, bits)
        back = dequantize(codes, scale, bits, torch.float32).numpy()
        groups = x.numpy().reshape(2, 3, 10, 2, 32)
        step = np.abs(groups).max(-1) / levels  # the scale before float16 rounding
        err = np.abs(back.reshape(groups.shape) - groups).max(-1)
        assert (err <= 0.5 * step * 1.002 + 1e-7).all(), bits


def test_bad_recall_settings_are_refused_naming_the_value():
    with pytest.raises(ValueError, match=r"recall fraction 0\.3 is outside \[0, 0\.25\)"):
        Recall(0.3).policy_ratio(0.75, 64, 2)
    with pytest.raises(ValueError, match="recall fraction 1.5 is not in"):
        Recall(1.5)
    with pytest.raises(ValueError, match="sketch 'bits'"):
        Recall(0.1, sketch="bits")
    with pytest.raises(ValueError, match="cold format 'zip'"):
        Recall(0.1, cold="zip")


def test_an_unwritable_cold_folder_fails_loudly(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    x = torch.randn(1, 2, 4, 16)
    with pytest.raises(OSError, match="could not be written under"):
        ColdLayer.from_entries(x, x, torch.zeros(1, 2, 4, dtype=torch.long), torch.ones(1, 2, 4, dtype=torch.bool),
                               "disk", blocked / "cold")


@torch.no_grad()
def test_nothing_evicted_or_a_one_token_context_recalls_nothing():
    model = tiny_model("llama", seed=2)
    for ids, ratio in ((header_ids(1, 100), 0.0), (torch.tensor([[40]]), 0.5)):
        read = read_prompt(model, ids, Capture())
        tiers = read.tiered(FullCache() if ratio == 0 else get("knorm", window=1), ratio,
                                    Recall(0.0 if ratio == 0 else 0.2))
        cache = tiers.question_cache()
        with attach(model, FullCache()):
            model(input_ids=torch.tensor([[50, 51]]), cache=cache, use_cache=True)
        assert tiers.recalled == 0 and tiers.cold_nbytes() == 0


@torch.no_grad()
def test_a_question_longer_than_the_hot_budget_is_read_whole():
    model = tiny_model("llama", seed=2)
    ids = header_ids(2, 80)
    n = ids.shape[1]
    tiers = _tiers(model, ids, ratio=0.875, fraction=0.05, chunk=4)
    question = header_ids(9, 40)[:, -40:]
    cache = tiers.question_cache()
    with attach(model, FullCache()):
        model(input_ids=question, cache=cache, use_cache=True)
    for _, layer in sieve_layers(cache):  # every question token is held, after what the context kept and recalled
        assert all(set(range(n, n + 40)) <= held for held in _held(layer))
        assert layer.seen == n + 40


@torch.no_grad()
def test_a_recalling_question_reads_exactly_what_a_mask_of_its_entries_shows():
    """The independent path: the full cache with every entry the recall left out masked (dense, masked sdpa). The
    question's logits on the recalled copy match it at every position, so the recalled entries sit at their own
    positions, before the question's tokens, in every layer."""
    model = sharpened(tiny_model("llama", seed=4))
    ids = header_ids(7, 140)
    n = ids.shape[1]
    tiers = _tiers(model, ids, ratio=0.75, fraction=0.1, chunk=8)
    question = header_ids(8, 7)[:, -7:]
    cache = tiers.question_cache()
    with attach(model, FullCache()):
        got = model(input_ids=question, cache=cache, use_cache=True).logits
    masked = read_prompt(model, ids, Capture()).cache
    for (_, layer), (_, recalled) in zip(sieve_layers(masked), sieve_layers(cache), strict=True):
        held = _held(recalled)
        keep = torch.tensor([[p in held[h] for p in range(n)] for h in range(len(held))])[None]
        layer.valid, layer.grow_in_place = keep, False
    with attach(model, FullCache()):
        want = model(input_ids=question, cache=masked, use_cache=True).logits
    assert tiers.recalled > 0
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@torch.no_grad()
def test_attach_with_recall_answers_as_the_tiers_of_a_read_do():
    """``kvsieve.attach(..., recall=)``: the prompt's forward leaves the caller's cache as the armed hot tier, the
    question's forward recalls: the same logits as a read split in two tiers, then asked."""
    model = sharpened(tiny_model("llama", seed=4))
    ids, question = header_ids(7, 140), header_ids(8, 7)[:, -7:]
    tiers = _tiers(model, ids, ratio=0.75, fraction=0.1, chunk=8)
    cache = tiers.question_cache()
    with attach(model, FullCache()):
        want = model(input_ids=question, cache=cache, use_cache=True).logits
    with attach(model, get("knorm"), ratio=0.75, recall=Recall(0.1, chunk=8)) as session:
        out = model(input_ids=ids, use_cache=True)
        got = model(input_ids=question, cache=out.cache, use_cache=True).logits
    assert session.tiers.recalled == tiers.recalled > 0
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="recall runs a prefill point"):
        with attach(model, get("knorm"), kept=10, recall=Recall(0.1)):
            pass


def test_the_sketches_estimate_q_dot_k_as_their_formulas_say():
    """sign: mean |k| x (q . sign(k)), the best over the queries; lowrank at full rank: q . k exactly (numpy)."""
    g = torch.Generator().manual_seed(0)
    keys, queries = torch.randn(1, 2, 9, 16, generator=g), torch.randn(1, 2, 5, 16, generator=g)
    valid = torch.ones(1, 2, 9, dtype=torch.bool)
    k, q = keys.numpy(), queries.numpy()
    scale = np.abs(k).mean(-1).astype(np.float16).astype(np.float32)
    want = np.einsum("bhqd,bhed->bhqe", q, np.sign(k)).max(2) * scale
    np.testing.assert_allclose(KeySketch.of(keys, valid, "sign").dot(queries).numpy(), want, rtol=1e-5, atol=1e-5)
    exact = np.einsum("bhqd,bhed->bhqe", q, k).max(2)
    np.testing.assert_allclose(KeySketch.of(keys, valid, "lowrank", rank=16).dot(queries).numpy(), exact, atol=0.05)
    with pytest.raises(ValueError, match="head dim 12 is not a multiple of 8"):
        KeySketch.of(torch.randn(1, 1, 3, 12), torch.ones(1, 1, 3, dtype=torch.bool), "sign")
