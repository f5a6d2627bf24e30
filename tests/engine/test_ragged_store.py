"""The segment store: one attention call per layer whatever the heads, appends in place, copies never shared."""

import pytest
import torch
from conftest import COMMON
from transformers import AutoModelForCausalLM, LlamaConfig

import kvsieve
from kvsieve.engine.attention import _varlen_attention, stored_attention
from kvsieve.engine.cache import (
    SieveLayer,
    cache_allocated_bytes,
    cache_bytes,
    clone_cache,
    reserve_room,
    sieve_layers,
    stack_caches,
)
from kvsieve.engine.ragged import BUCKETS, RaggedStore
from kvsieve.policies import FullCache, get
from kvsieve.selection import Selection


def model_with(kv_heads: int, heads: int = 8):
    torch.manual_seed(0)
    config = LlamaConfig(**dict(COMMON, num_attention_heads=heads, num_key_value_heads=kv_heads))
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def ragged_cache(model, ids):
    policy = get("snapkv", window=8, selection=Selection(recent=8, allocation="global", normalization="zscore"))
    with kvsieve.attach(model, policy, ratio=0.5):
        return model(input_ids=ids, use_cache=True).cache


@pytest.mark.parametrize("kv_heads", [1, 2, 4, 8, 16])
@torch.no_grad()
def test_a_ragged_decode_step_makes_a_constant_number_of_attention_calls_per_layer(kv_heads, monkeypatch):
    model = model_with(kv_heads, heads=max(8, kv_heads))
    ids = torch.randint(1, 128, (1, 96), generator=torch.Generator().manual_seed(1))
    cache = ragged_cache(model, ids)
    layers = sieve_layers(cache)
    if kv_heads > 1:
        assert all(layer.is_ragged for _, layer in layers)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    with kvsieve.attach(model, FullCache(window=4), ratio=0.0):
        for token in ([5], [9], [17]):
            calls.clear()
            model(input_ids=torch.tensor([token]), cache=cache, use_cache=True)
            # one call per capacity bucket: at most BUCKETS per layer, however many heads
            assert len(layers) <= len(calls) <= BUCKETS * len(layers)


@torch.no_grad()
def test_appends_write_in_place_until_the_spare_room_is_used():
    model = model_with(2, 4)
    ids = torch.randint(1, 128, (1, 96), generator=torch.Generator().manual_seed(2))
    cache = ragged_cache(model, ids)
    layer = sieve_layers(cache)[0][1]
    before = layer.store.lengths.clone()
    with kvsieve.attach(model, FullCache(window=4), ratio=0.0):
        model(input_ids=torch.tensor([[3]]), cache=cache, use_cache=True)  # the first append grows once
        buffer = layer.store.keys.data_ptr()
        spare = int((layer.store.capacity - layer.store.lengths).min())
        assert spare >= 64  # documented: at least 64 entries of room
        for step in range(spare):
            model(input_ids=torch.tensor([[4 + step % 50]]), cache=cache, use_cache=True)
            assert layer.store.keys.data_ptr() == buffer  # no copy of the layer
        assert layer.store.lengths.tolist() == (before + 1 + spare).tolist()
        model(input_ids=torch.tensor([[7]]), cache=cache, use_cache=True)
        assert layer.store.keys.data_ptr() != buffer  # room used up: it grew (a copy)


@torch.no_grad()
def test_a_clone_decoding_never_changes_the_cache_it_was_cloned_from():
    model = model_with(2, 4)
    ids = torch.randint(1, 128, (1, 96), generator=torch.Generator().manual_seed(3))
    cache = ragged_cache(model, ids)
    untouched = clone_cache(cache)
    with kvsieve.attach(model, FullCache(window=4), ratio=0.0):
        copy = clone_cache(cache)
        for token in (11, 12, 13):
            model(input_ids=torch.tensor([[token]]), cache=copy, use_cache=True)
        a = model(input_ids=torch.tensor([[21]]), cache=cache, use_cache=True).logits
        b = model(input_ids=torch.tensor([[21]]), cache=untouched, use_cache=True).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_store_segments_round_trip_against_a_plain_list_of_kept_entries():
    g = torch.Generator().manual_seed(4)
    b, h, n, d = 2, 3, 10, 4
    keys = torch.randn(b, h, n, d, generator=g)
    positions = torch.arange(n).expand(b, h, n).clone()
    valid = torch.rand(b, h, n, generator=g) > 0.4
    valid[..., 0] = True
    store = RaggedStore.from_dense(keys, keys * 2, positions, valid)
    assert store.lengths.tolist() == valid.sum(-1).reshape(-1).tolist()
    assert store.nbytes() == int(valid.sum()) * 2 * d * 4  # exactly the kept entries
    dense = store.padded(pad_at=0)
    for r in range(b):
        for i in range(h):
            kept = [j for j in range(n) if valid[r, i, j]]
            row_valid = dense["valid"][r, i] if dense["valid"] is not None else torch.ones(store.width, dtype=bool)
            assert dense["positions"][r, i][row_valid].tolist() == kept
            assert torch.equal(dense["keys"][r, i][row_valid], keys[r, i, kept])
            assert not bool(row_valid[: store.width - len(kept)].any())  # left padding
    new = torch.randn(b, h, 2, d, generator=g)
    grown = store.append(new, new * 2, torch.full((b, h, 2), n))
    dense = grown.padded(pad_at=0)
    assert torch.equal(dense["keys"][:, :, -2:], new)  # every segment's newest entries at its end
    alone = grown.select_rows(torch.tensor([1])).padded(pad_at=0)
    for i in range(h):
        kept = [j for j in range(n) if valid[1, i, j]] + [n, n]
        width = alone["keys"].shape[2]
        row_valid = alone["valid"][0, i] if alone["valid"] is not None else torch.ones(width, dtype=bool)
        assert alone["positions"][0, i][row_valid].tolist() == kept


def reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                     seqused_k=None, enable_gqa=False):
    """varlen_attn's documented semantics, one sequence at a time: sequence i's queries
    ``cu_seq_q[i]:cu_seq_q[i+1]`` attend its keys ``cu_seq_k[i]:`` (the first ``seqused_k[i]`` of them, else up to
    ``cu_seq_k[i+1]``); query heads share key heads by head counts; (-1, 0) is causal, aligned bottom-right."""
    out = torch.zeros(query.shape[0], query.shape[1], value.shape[-1], dtype=query.dtype)
    groups = query.shape[1] // key.shape[1]
    for i in range(len(cu_seq_q) - 1):
        q0, q1 = int(cu_seq_q[i]), int(cu_seq_q[i + 1])
        k0 = int(cu_seq_k[i])
        k1 = k0 + int(seqused_k[i]) if seqused_k is not None else int(cu_seq_k[i + 1])
        if q1 == q0:
            continue
        for head in range(query.shape[1]):
            q, k, v = query[q0:q1, head], key[k0:k1, head // groups], value[k0:k1, head // groups]
            logits = (q @ k.T) * scale
            if window_size == (-1, 0):
                n, m = q1 - q0, k1 - k0
                logits = logits.masked_fill(torch.arange(m)[None, :] > (m - n + torch.arange(n))[:, None], -torch.inf)
            out[q0:q1, head] = torch.softmax(logits, -1) @ v
    return out


@pytest.mark.parametrize("seqused, gqa_flag", [(True, True), (False, False)])
@pytest.mark.parametrize("q_len", [1, 3])
def test_varlen_packing_matches_the_padded_path(seqused, gqa_flag, q_len):
    """The CUDA path's packing of segments into varlen sequences (the kernel replaced by its documented semantics,
    torch 2.13's signature and 2.11's), against the padded sdpa path."""
    g = torch.Generator().manual_seed(5)
    b, h, n, d, hq = 2, 3, 12, 8, 6
    keys = torch.randn(b, h, n, d, generator=g)
    valid = torch.rand(b, h, n, generator=g) > 0.3
    valid[..., :2] = True
    layer = SieveLayer()
    store = RaggedStore.from_dense(keys, torch.randn(b, h, n, d, generator=g), torch.arange(n).expand(b, h, n),
                                   valid, spare=5)
    new = torch.randn(b, h, q_len, d, generator=g)
    layer.store = store.append(new, new.flip(-1), torch.full((b, h, q_len), n))
    query = torch.randn(b, hq, q_len, d, generator=g)
    expected = stored_attention(query, layer, 0.3)  # on the CPU: the padded sdpa path
    got = _varlen_attention(query, layer.store, 0.3, (reference_varlen, seqused, gqa_flag))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_reserved_room_holds_a_whole_answer_and_a_batch_allocates_what_its_requests_do():
    model = model_with(4, 8)
    caches = []
    for seed, ratio in ((6, 0.5), (7, 0.875)):
        ids = torch.randint(1, 128, (1, 96 + 40 * seed % 3), generator=torch.Generator().manual_seed(seed))
        policy = get("snapkv", window=8, selection=Selection(recent=8, allocation="global", normalization="zscore"))
        with kvsieve.attach(model, policy, ratio=ratio):
            caches.append(reserve_room(model(input_ids=ids, use_cache=True).cache, 10))
    alone = [cache_allocated_bytes(c) for c in caches]
    for cache in caches:
        held = cache_bytes(cache)
        assert held < cache_allocated_bytes(cache)
        for _, layer in sieve_layers(cache):  # every segment has room for 10 more
            assert bool((layer.store.capacity - layer.store.lengths >= 10).all())
    batch = stack_caches(caches)
    assert cache_allocated_bytes(batch) == sum(alone)  # nothing rounded across requests
    buffers = [layer.store.keys.data_ptr() for _, layer in sieve_layers(batch)]
    with kvsieve.attach(model, FullCache(window=4), ratio=0.0):
        for step in range(10):
            model(input_ids=torch.tensor([[3 + step], [4 + step]]), cache=batch, use_cache=True,
                  position_ids=torch.tensor([[200 + step], [200 + step]]))
    assert [layer.store.keys.data_ptr() for _, layer in sieve_layers(batch)] == buffers  # appended in place
    assert cache_allocated_bytes(batch) == sum(alone)
    batch.batch_select_indices(torch.tensor([1]))  # the first request leaves: the second keeps its own room
    assert cache_allocated_bytes(batch) == alone[1]
