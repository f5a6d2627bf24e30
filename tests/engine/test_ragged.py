"""Ragged per-head storage: each KV head at its own length, equal to the masked full cache, bytes exact."""

import copy

import pytest
import torch
from conftest import CharTokenizer, tiny_model

import kvsieve
from kvsieve.engine.cache import SieveLayer, cache_allocated_bytes, cache_bytes, sieve_layers, stack_caches
from kvsieve.engine.generate import generate
from kvsieve.policies import FullCache, get
from kvsieve.selection import Selection

N = 96


@torch.no_grad()
def full_cache(model, ids):
    with kvsieve.attach(model, FullCache(window=4), ratio=0.0):
        return model(input_ids=ids, use_cache=True).cache


def random_kept_sets(model, seed: int, n: int = N) -> dict[int, list[list[int]]]:
    """Per layer and KV head, a random set of kept positions of a random size (always holding position 0)."""
    g = torch.Generator().manual_seed(seed)
    heads = model.config.num_key_value_heads
    out = {}
    for layer in range(model.config.num_hidden_layers):
        sets = []
        for _ in range(heads):
            size = int(torch.randint(8, n - 8, (1,), generator=g))
            rest = (torch.randperm(n - 1, generator=g)[: size - 1] + 1).tolist()
            sets.append(sorted([0, *rest]))
        out[layer] = sets
    return out


def prune_to(cache, kept: dict[int, list[list[int]]]):
    """Prune every layer of (a copy of) ``cache`` to ``kept``: indices padded to the widest head, masked."""
    cache = clone(cache)
    for idx, layer in sieve_layers(cache):
        sets = kept[idx]
        width = max(len(s) for s in sets)
        indices = torch.tensor([s + [s[-1]] * (width - len(s)) for s in sets])[None]
        valid = torch.tensor([[True] * len(s) + [False] * (width - len(s)) for s in sets])[None]
        layer.prune(indices, valid)
    return cache


def masked(cache, kept: dict[int, list[list[int]]]):
    """The full cache with every entry outside ``kept`` masked (nothing freed): the reference."""
    cache = clone(cache)
    for idx, layer in sieve_layers(cache):
        mask = torch.zeros_like(layer.positions, dtype=torch.bool)
        for h, s in enumerate(kept[idx]):
            mask[0, h, s] = True
        layer.valid = mask
        layer.grow_in_place = False  # stays dense: masked sdpa, not the segment store under test
    return cache


def clone(cache):
    out = copy.copy(cache)
    out.layers = [copy.copy(layer) for layer in cache.layers]
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@torch.no_grad()
def test_ragged_cache_gives_the_logits_of_the_masked_full_cache(arch, prompt_ids):
    model = tiny_model(arch)
    base = full_cache(model, prompt_ids)
    kept = random_kept_sets(model, seed=3)
    ragged, reference = prune_to(base, kept), masked(base, kept)
    assert all(layer.is_ragged for _, layer in sieve_layers(ragged))
    # bytes: exactly the kept entries times one head's key + value (float32, head dim 16)
    entry = 2 * 16 * 4
    assert cache_bytes(ragged) == sum(len(s) for sets in kept.values() for s in sets) * entry
    for idx, layer in sieve_layers(ragged):
        assert [h.positions[0].tolist() for h in layer.heads] == kept[idx]
    with kvsieve.attach(model, FullCache(window=4), ratio=0.0):
        question = torch.tensor([[5, 9, 17, 33]])  # a multi-token forward (bottom-right causal per head)
        a = model(input_ids=question, cache=ragged, use_cache=True).logits
        b = model(input_ids=question, cache=reference, use_cache=True).logits
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        for _ in range(4):  # decode steps: the new token goes to every head
            token = a[:, -1].argmax(-1, keepdim=True)
            a = model(input_ids=token, cache=ragged, use_cache=True).logits
            b = model(input_ids=token, cache=reference, use_cache=True).logits
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # every segment holds its entries + the 8 new ones; the first append gave it spare room once
    # (documented: an eighth of its new length, at least 64), and the 4 later tokens fit in it
    for idx, layer in sieve_layers(ragged):
        assert layer.store.lengths.tolist() == [len(s) + 8 for s in kept[idx]]
    allocated = sum(len(s) + 4 + max(64, (len(s) + 4) // 8) for sets in kept.values() for s in sets)
    assert cache_allocated_bytes(ragged) == allocated * entry
    assert cache_bytes(ragged) == sum(len(s) + 8 for sets in kept.values() for s in sets) * entry
    assert all(layer.seen == N + 8 for _, layer in sieve_layers(ragged))


@torch.no_grad()
def test_ragged_layer_refuses_to_run_outside_attach(llama, prompt_ids):
    ragged = prune_to(full_cache(llama, prompt_ids), random_kept_sets(llama, seed=1))
    with pytest.raises(RuntimeError, match="inside kvsieve.attach"):
        llama(input_ids=torch.tensor([[3]]), cache=ragged, use_cache=True)


@torch.no_grad()
def test_batched_ragged_cells_hold_each_rows_own_entries(prompt_ids):
    model = tiny_model("qwen2")
    base = full_cache(model, prompt_ids)
    kept = [random_kept_sets(model, seed=s) for s in (4, 5)]
    rows = [prune_to(base, k) for k in kept]
    batch = stack_caches(rows)
    for idx, layer in sieve_layers(batch):
        assert layer.is_ragged
        widths = [max(len(k[idx][h]) for k in kept) for h in range(2)]
        assert layer.head_lengths == widths  # a head's longest row
        # no padding at all: every (row, head) holds exactly its own entries
        assert layer.nbytes() == sum(len(k[idx][h]) for k in kept for h in range(2)) * 2 * 16 * 4
    with kvsieve.attach(model, FullCache(window=4), ratio=0.0):
        token = torch.tensor([[7], [7]])
        for _ in range(3):
            together = model(input_ids=token, cache=batch, use_cache=True).logits[:, -1]
            alone = torch.cat([model(input_ids=token[i:i + 1], cache=rows[i], use_cache=True).logits[:, -1]
                               for i in range(2)])
            torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-4)
            token = together.argmax(-1, keepdim=True)
        batch.batch_select_indices(torch.tensor([1]))  # a finished row leaves: the other decodes on
        out = model(input_ids=token[1:], cache=batch, use_cache=True).logits[:, -1]
        ref = model(input_ids=token[1:], cache=rows[1], use_cache=True).logits[:, -1]
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
        for idx, layer in sieve_layers(batch):  # the padding only the finished row needed is gone
            assert layer.head_lengths == [len(s) + 4 for s in kept[1][idx]]


@pytest.mark.parametrize("policy", ["adakv", "global_snapkv"])
@torch.no_grad()
def test_uneven_policies_hold_exactly_their_budget_and_decode_as_masked(prompt_ids, policy):
    model = tiny_model("llama")
    if policy == "adakv":
        chosen = get("adakv", window=8)
    else:  # snapkv's scores under a model-wide budget, standardised per head (documented normalization)
        chosen = get("snapkv", window=8, selection=Selection(recent=8, allocation="global", normalization="zscore"))
    with kvsieve.attach(model, chosen, ratio=0.75) as session:
        cache = model(input_ids=prompt_ids, use_cache=True).cache
    layers = sieve_layers(cache)
    kept = {idx: [h.positions[0].tolist() for h in layer.heads] if layer.is_ragged
            else layer.positions[0].tolist() for idx, layer in layers}
    counts = [len(s) for sets in kept.values() for s in sets]
    assert sum(counts) == 3 * 2 * 24  # layers x heads x (96 * 0.25): the budget exactly
    assert cache_bytes(cache) == sum(counts) * 2 * 16 * 4 == session.report.bytes_after
    assert min(counts) >= 8 and len(set(counts)) > 1  # floors hold; the heads really differ
    reference = masked(full_cache(model, prompt_ids), kept)
    with kvsieve.attach(model, FullCache(window=4), ratio=0.0):
        token = torch.tensor([[11]])
        for _ in range(3):
            a = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1]
            b = model(input_ids=token, cache=reference, use_cache=True).logits[:, -1]
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
            token = a.argmax(-1, keepdim=True)


@torch.no_grad()
def test_global_allocation_of_scores_not_comparable_across_layers_is_refused(llama, prompt_ids):
    with pytest.raises(ValueError, match="comparable across layers.*normalization='zscore'"):
        policy = get("snapkv", window=8, selection=Selection(recent=8, allocation="global"))
        with kvsieve.attach(llama, policy, ratio=0.5):
            llama(input_ids=prompt_ids, use_cache=True)
    with pytest.raises(ValueError, match="allocation 'cone'"):
        Selection(allocation="cone")
    get("kvzip", allocation="global")  # declares its scores comparable everywhere


@torch.no_grad()
def test_decode_eviction_of_ragged_heads_stays_within_budget_plus_chunk(llama, prompt_ids):
    chunk, kept = 16, 32
    with kvsieve.attach(llama, get("adakv", window=8), kept=kept, mode="decode", chunk_size=chunk,
                        evict_every=8) as session:
        out = llama(input_ids=prompt_ids, use_cache=True)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        for _ in range(20):
            token = llama(input_ids=token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            for _, layer in sieve_layers(cache):  # the layer's total: at most budget + evict_every per head
                assert sum(layer.head_lengths) <= 2 * (kept + max(chunk, 8))
    ragged = [layer for _, layer in sieve_layers(cache) if layer.is_ragged]
    assert ragged  # adakv's heads differ in decode mode too
    entries = sum(sum(layer.head_lengths) for _, layer in sieve_layers(cache))
    allocated = sum(layer.store.capacity.sum().item() if layer.store is not None else sum(layer.head_lengths)
                    for _, layer in sieve_layers(cache))
    assert allocated >= entries
    assert cache_allocated_bytes(cache) == allocated * 2 * 16 * 4
    assert session.peak_cache_bytes >= cache_bytes(cache) == entries * 2 * 16 * 4
    assert session.peak_cache_bytes <= 3 * 2 * (kept + chunk) * 2 * 16 * 4  # entries held: within budget + chunk


@torch.no_grad()
def test_evict_every_evicts_generated_tokens_once_per_that_many(llama, prompt_ids):
    events = {}
    for every in (1, 8):
        with kvsieve.attach(llama, get("knorm", window=8), kept=40, mode="decode", chunk_size=32,
                            evict_every=every) as session:
            out = llama(input_ids=prompt_ids, use_cache=True)
            cache, token = out.cache, out.logits[:, -1:].argmax(-1)
            prompt_events = session.report.events
            lengths = []
            for _ in range(24):
                token = llama(input_ids=token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
                lengths.append(sieve_layers(cache)[0][1].physical_length)
        events[every] = session.report.events - prompt_events
        assert max(lengths) <= 40 + every and session.peak_tokens <= 40 + max(32, every)
    assert events == {1: 24, 8: 3}


@torch.no_grad()
def test_decode_mode_accepts_a_kept_budget_above_the_prompt(llama, prompt_ids):
    with kvsieve.attach(llama, get("knorm", window=8), kept=200, mode="decode", chunk_size=32) as session:
        out = llama(input_ids=prompt_ids, use_cache=True)
    assert session.budget_tokens == 200 and out.cache.get_seq_length() == N
    assert all(layer.physical_length == N for _, layer in sieve_layers(out.cache))  # nothing to evict yet


def test_generate_refuses_a_request_longer_than_the_model_context(llama):
    tokenizer = CharTokenizer()
    with pytest.raises(ValueError, match=r"longer than the model's context of 512 tokens"):
        generate(llama, tokenizer, "x" * 600, "q?", max_new_tokens=4)
    with pytest.raises(ValueError, match=r"max_new_tokens=40 .* 512"):
        generate(llama, tokenizer, "x" * 470, "q?", max_new_tokens=40)
    assert generate(llama, tokenizer, "x" * 400, "q?", max_new_tokens=2).context_tokens < 512


def test_sieve_layer_dense_view_of_a_ragged_layer_is_padded_and_masked(llama, prompt_ids):
    kept = random_kept_sets(llama, seed=2)
    layer = sieve_layers(prune_to(full_cache(llama, prompt_ids), kept))[0][1]
    assert isinstance(layer, SieveLayer) and layer.is_ragged
    width = max(len(s) for s in kept[0])
    assert layer.keys.shape == (1, 2, width, 16) and layer.physical_length == width
    for h, s in enumerate(kept[0]):  # left padding: every head's newest entries line up at the end
        assert layer.positions[0, h][layer.valid[0, h]].tolist() == s
        assert not bool(layer.valid[0, h, : width - len(s)].any())
