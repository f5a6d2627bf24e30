"""engine/query_hooks.py: the pre-RoPE query statistics the hooks collect, against the queries recomputed from the
model's own hidden states (input norm -> q_proj -> q_norm where the model has one), with the mean and the centred
scatter written out directly; the hooks exist only while a policy asks and are gone afterwards, also on error."""

import pytest
import torch
from conftest import tiny_model

import kvsieve
from kvsieve.engine.cache import sieve_layers
from kvsieve.policy import FullCache
from kvsieve.query_stats import EARLY_POSITIONS


def asking(window: int = 4) -> FullCache:
    policy = FullCache(window=window)
    policy.needs_query_stats = True
    return policy


def pre_rope_queries(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, (b, hq, n, d) float64 queries before the rotary embedding, recomputed from the hidden states that
    enter each decoder layer (no hooks: ``output_hidden_states``)."""
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    out = []
    for layer, h in zip(model.model.layers, hidden):
        attention = layer.self_attn
        q = attention.q_proj(layer.input_layernorm(h))
        q = q.view(*q.shape[:2], -1, attention.head_dim)
        if hasattr(attention, "q_norm"):
            q = attention.q_norm(q)
        out.append(q.transpose(1, 2).double())
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3 normalises its queries (q_norm) before RoPE
@torch.no_grad()
def test_statistics_equal_the_mean_and_scatter_of_the_recomputed_queries(arch):
    model = tiny_model(arch)
    n, extra = 96, 3
    ids = torch.randint(1, 128, (2, n + extra), generator=torch.Generator().manual_seed(3))
    with kvsieve.attach(model, asking(), ratio=0.0):
        cache = model(input_ids=ids[:, :n], use_cache=True).cache
        for t in range(n, n + extra):  # decode steps add their queries one at a time
            model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
    expected = pre_rope_queries(model, ids)
    for idx, layer in sieve_layers(cache):
        stats, queries = layer.query_stats, expected[idx]
        rest = queries[:, :, EARLY_POSITIONS:]
        mean = rest.mean(dim=2)
        centred = rest - mean[:, :, None]
        scatter = torch.einsum("bhqi,bhqj->bhij", centred, centred)
        assert stats.total == n + extra and stats.count == n + extra - EARLY_POSITIONS
        torch.testing.assert_close(stats.early.double(), queries[:, :, :EARLY_POSITIONS], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(stats.mean.double(), mean, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(stats.m2.double(), scatter, atol=1e-4, rtol=1e-4)
        inv_freq = model.model.rotary_emb.inv_freq
        assert layer.rope is not None and torch.equal(layer.rope[0], inv_freq)


def hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@torch.no_grad()
def test_hooks_only_while_a_policy_asks_and_removed_also_on_error():
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 20), generator=torch.Generator().manual_seed(4))
    before = hook_count(model)
    with kvsieve.attach(model, FullCache(window=4), ratio=0.0):  # a policy that does not ask: no statistics
        assert hook_count(model) == before
        cache = model(input_ids=ids, use_cache=True).cache
    assert all(layer.query_stats is None for _, layer in sieve_layers(cache))
    with pytest.raises(RuntimeError, match="boom"):
        with kvsieve.attach(model, asking(), ratio=0.0):
            assert hook_count(model) > before
            model(input_ids=ids, use_cache=True)
            raise RuntimeError("boom")
    assert hook_count(model) == before
    assert not any("_kvsieve_query_layer" in vars(m) for m in model.modules())


@torch.no_grad()
def test_statistics_that_no_longer_describe_the_cache_are_dropped():
    """A layer whose statistics do not cover it from its first token (or cover other rows) gets none, so a policy
    that needs them fails loudly instead of reading another cache's queries."""
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 20), generator=torch.Generator().manual_seed(5))
    with kvsieve.attach(model, FullCache(window=4), ratio=0.0):
        cache = model(input_ids=ids[:, :10], use_cache=True).cache  # nothing collected for the first 10 tokens
    with kvsieve.attach(model, asking(), ratio=0.0):
        model(input_ids=ids[:, 10:], cache=cache, use_cache=True)
    assert all(layer.query_stats is None for _, layer in sieve_layers(cache))
    with kvsieve.attach(model, asking(), ratio=0.0):
        cache = model(input_ids=ids[:, :10], use_cache=True).cache
        layer = sieve_layers(cache)[0][1]
        assert layer.query_stats.total == 10
        layer.query_stats = layer.query_stats[[0, 0]]  # two rows: not this cache's one
        model(input_ids=ids[:, 10:11], cache=cache, use_cache=True)
        assert layer.query_stats is None and sieve_layers(cache)[1][1].query_stats.total == 11
