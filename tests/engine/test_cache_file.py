"""A cache saved with save_cache and read back with load_cache computes what the original computes."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import kvsieve
from kvsieve.engine.cache import SieveLayer, sieve_layers
from kvsieve.engine.cache_file import load_cache, save_cache
from kvsieve.policies import get
from kvsieve.policy import FullCache

IDS = torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(7))
MORE = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(8))


def _prefill(model, policy, ratio: float):
    with kvsieve.attach(model, policy, ratio=ratio), torch.no_grad():
        return model(input_ids=IDS, use_cache=True).cache


def _continue(model, cache) -> torch.Tensor:
    """Logits of six more tokens read one at a time (each reads the cache the tokens before it grew)."""
    rows = []
    with kvsieve.attach(model, FullCache(window=4), ratio=0.0), torch.no_grad():
        for t in range(MORE.shape[1]):
            rows.append(model(input_ids=MORE[:, t:t + 1], cache=cache, use_cache=True).logits[0, -1])
    return torch.stack(rows)


@pytest.mark.parametrize("policy, ratio", [
    (FullCache(window=4), 0.0),  # what the evolution's dev set saves: nothing pruned
    (get("h2o", window=4), 0.5),  # pruned (positions no longer 0..n-1, fewer entries than tokens seen), attention
])
def test_a_loaded_cache_holds_the_same_state_and_continues_with_the_same_logits(tmp_path, policy, ratio):
    model = tiny_model("llama")
    cache = _prefill(model, policy, ratio)
    layers = sieve_layers(cache)
    assert not any(layer.is_ragged for _, layer in layers)
    if ratio:
        assert all(layer.physical_length < layer.seen for _, layer in layers)
        assert all(layer.attention_received is not None for _, layer in layers)
    save_cache(tmp_path / "c.safetensors", cache, {"note": "hello"})
    loaded, meta = load_cache(tmp_path / "c.safetensors", model.config)
    assert meta == {"note": "hello"}
    for (_, a), (_, b) in zip(layers, sieve_layers(loaded)):
        assert a.seen == b.seen and a.window == b.window and a.scaling == b.scaling
        for name in ("keys", "values", "positions", "attention_received", "recent_queries"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None and y is None) or torch.equal(x, y), name
        assert torch.equal(a.rope[0], b.rope[0]) if a.rope is not None else b.rope is None
    assert torch.equal(_continue(model, cache), _continue(model, loaded))


def test_a_changed_entry_changes_the_continuation(tmp_path):
    # the comparison above can tell caches apart: one key changed in the file's source gives other logits
    model = tiny_model("llama")
    cache = _prefill(model, FullCache(window=4), 0.0)
    save_cache(tmp_path / "c.safetensors", cache)
    loaded, _ = load_cache(tmp_path / "c.safetensors", model.config)
    layer = sieve_layers(loaded)[1][1]
    keys = layer.keys.clone()
    keys[0, 0, 40] += 1.0
    layer.keys = keys
    assert not torch.equal(_continue(model, cache), _continue(model, loaded))


def test_what_cannot_be_saved_whole_is_refused(tmp_path):
    model = tiny_model("llama")
    ragged = _prefill(model, FullCache(window=4), 0.0)
    layer = sieve_layers(ragged)[0][1]
    layer.prune(torch.tensor([[[0, 1, 2], [3, 4, 4]]]), torch.tensor([[[True, True, True], [True, True, False]]]))
    assert layer.is_ragged and layer.head_lengths == [3, 2]
    with pytest.raises(ValueError, match="per-head segments"):
        save_cache(tmp_path / "r.safetensors", ragged)
    assert not list(tmp_path.iterdir())  # nothing half-written
    gemma = tiny_model("gemma3")
    with pytest.raises(ValueError, match="not a kvsieve layer"):
        with kvsieve.attach(gemma, FullCache(window=4), ratio=0.0), torch.no_grad():
            save_cache(tmp_path / "g.safetensors", gemma(input_ids=IDS, use_cache=True).cache)


def test_a_file_for_another_model_or_format_is_refused(tmp_path):
    model = tiny_model("llama")
    save_cache(tmp_path / "c.safetensors", _prefill(model, FullCache(window=4), 0.0))
    deeper = model.config.__class__(**{**model.config.to_dict(), "num_hidden_layers": 4})
    with pytest.raises(ValueError, match="holds 3 layers; a cache of this model has 4"):
        load_cache(tmp_path / "c.safetensors", deeper)
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"), metadata={"format": "0"})
    with pytest.raises(ValueError, match="not a kvsieve cache file"):
        load_cache(tmp_path / "other.safetensors", model.config)
    assert isinstance(load_cache(tmp_path / "c.safetensors", model.config)[0].layers[0], SieveLayer)
