"""Cache surgery on tiny random models: budgets, bytes, positions, hooks, decode-time eviction."""

import pytest
import torch
from conftest import tiny_model
from transformers.cache_utils import DynamicCache

import kvsieve
from kvsieve.engine.cache import SieveLayer, sieve_layers
from kvsieve.engine.compress import layer_signals
from kvsieve.policies import get, names

# kvzip needs a tokenizer and a reconstruction forward, and refuses decode mode: tests/policies/test_kvzip.py covers it
COMPRESSING = [n for n in names(kinds=("policy",)) if n not in ("full", "kvzip")]


@torch.no_grad()
def prefill(model, ids, policy, **kwargs):
    with kvsieve.attach(model, policy, **kwargs) as session:
        out = model(input_ids=ids, use_cache=True)
    return out.cache, session


@pytest.mark.parametrize("name", COMPRESSING)
@torch.no_grad()
def test_kept_entries_are_the_top_scores_and_protected(llama, prompt_ids, name):
    policy = get(name, window=16)
    full_cache, _ = prefill(llama, prompt_ids, policy, ratio=0.0)
    cache, session = prefill(llama, prompt_ids, policy, ratio=0.5)
    num_layers = len(cache.layers)
    for idx, layer in sieve_layers(cache):
        reference = full_cache.layers[idx]
        signals = layer_signals(reference, idx, num_layers)
        scores = policy.score(signals)
        kept_layer = policy.selection.layer_kept(48, 96, idx, num_layers)
        expected, valid = policy.selection.kept_indices(scores, kept_layer)
        if valid is None:
            assert not layer.is_ragged and torch.equal(layer.positions, expected), name
        else:  # heads at their own lengths: each head holds exactly its kept entries, in order
            assert [head.positions[0].tolist() for head in layer.heads] == [
                expected[0, h][valid[0, h]].tolist() for h in range(expected.shape[1])], name
        sel = policy.selection
        for head in range(scores.shape[1]):
            kept = expected[0, head] if valid is None else expected[0, head][valid[0, head]]
            kept_set = set(kept.tolist())
            protected = set(torch.nonzero(sel.protected_mask(96, kept_layer)).flatten().tolist())
            assert protected <= kept_set
            if sel.chunk_size == 1:
                free_kept = [scores[0, head, i] for i in kept_set - protected]
                dropped = [scores[0, head, i] for i in set(range(96)) - kept_set]
                if free_kept and dropped:
                    assert min(free_kept) >= max(dropped)
        # the kept keys are the reference keys at those positions: a physical gather
        for h, (keys, positions) in enumerate(zip(stored(layer, "keys"), stored(layer, "positions"))):
            assert torch.equal(keys[0], reference.keys[0, h, positions[0]])


def stored(layer, name: str) -> list[torch.Tensor]:
    """What each head of ``layer`` physically stores: (b, n_h, ...) per head, ragged or dense."""
    if layer.is_ragged:
        return [getattr(head, name) for head in layer.heads]
    return list(getattr(layer, name).unbind(1))


@pytest.mark.parametrize("name", ["snapkv", "knorm", "streaming_llm", "h2o"])  # chunkkv: whole chunks only
def test_cache_length_and_bytes_equal_the_budget(llama, prompt_ids, name):
    cache, session = prefill(llama, prompt_ids, get(name, window=16), ratio=0.75)
    for _, layer in sieve_layers(cache):
        assert layer.keys.shape[-2] == 24 and layer.values.shape[-2] == 24
        per_token = 2 * layer.keys.shape[1] * layer.keys.shape[-1] * layer.keys.element_size()
        assert layer.nbytes() == 24 * per_token
    report = session.report
    assert report.bytes_after * 4 == report.bytes_before
    cache, _ = prefill(llama, prompt_ids, get(name, window=16), kept=30)
    assert all(layer.physical_length == 30 for _, layer in sieve_layers(cache))


def test_pyramid_layers_have_different_lengths_and_still_decode(llama, prompt_ids):
    with kvsieve.attach(llama, get("pyramidkv", window=16), ratio=0.5) as session:
        out = llama.generate(prompt_ids, max_new_tokens=5, do_sample=False)
    lengths = session.report.tokens_after
    assert lengths == sorted(lengths, reverse=True) and lengths[0] > lengths[-1]
    assert out.shape[1] == 96 + 5


def test_adakv_holds_exactly_its_budget_in_bytes(llama, prompt_ids):
    cache, session = prefill(llama, prompt_ids, get("adakv", window=16), ratio=0.5)
    uneven = 0
    for report, (_, layer) in zip(session.report.layers, sieve_layers(cache)):
        counts = layer.head_lengths  # entries each KV head stores (batch 1: all of them real)
        h, d = len(counts), llama.config.hidden_size // llama.config.num_attention_heads
        assert sum(counts) == h * 48  # the layer's budget exactly: heads share it, none is lost or added
        assert min(counts) >= 16  # every head keeps at least its window (the safeguard floor)
        assert report.tokens_after == max(counts)
        entry = 2 * d * 4  # one float32 key and value of one head
        assert report.bytes_after == layer.nbytes() == sum(counts) * entry  # no padding is stored
        positions = [head.positions[0].tolist() for head in layer.heads] if layer.is_ragged else \
            layer.positions[0].tolist()
        assert all(len(set(p)) == c for p, c in zip(positions, counts))  # distinct
        uneven += len(set(counts)) > 1
    assert uneven > 0  # not vacuous: in some layer the heads really got different budgets


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma3"])
def test_ratio_zero_gives_identical_greedy_output(arch, prompt_ids):
    model = tiny_model(arch)
    reference = model.generate(prompt_ids, max_new_tokens=10, do_sample=False)
    with kvsieve.attach(model, get("snapkv", window=16), ratio=0.0):
        compressed = model.generate(prompt_ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(reference, compressed)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_pruned_cache_equals_masked_full_cache(arch, prompt_ids):
    """Physical pruning gives the logits of the full cache with the evicted entries masked out."""
    model = tiny_model(arch)
    policy = get("random", seed=3, window=8)
    pruned, _ = prefill(model, prompt_ids, policy, ratio=0.6)
    masked, _ = prefill(model, prompt_ids, policy, ratio=0.0)
    for idx, layer in sieve_layers(pruned):
        keep = torch.zeros_like(masked.layers[idx].positions, dtype=torch.bool)
        keep.scatter_(2, layer.positions, True)
        masked.layers[idx].valid = keep
        masked.layers[idx].grow_in_place = False  # stays dense: masked sdpa, the independent path
    nxt = torch.tensor([[5, 7, 9]])
    with kvsieve.attach(model, policy, ratio=0.6):
        a = model(input_ids=nxt, cache=pruned, use_cache=True).logits
        b = model(input_ids=nxt, cache=masked, use_cache=True).logits
    assert pruned.get_seq_length() == 99
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_hooks_are_removed_even_on_error(llama, prompt_ids):
    impl = llama.config._attn_implementation
    with pytest.raises(RuntimeError, match="boom"):
        with kvsieve.attach(llama, get("snapkv", window=16), ratio=0.5):
            llama(input_ids=prompt_ids, use_cache=True)
            raise RuntimeError("boom")
    assert "forward" not in llama.__dict__
    assert llama.config._attn_implementation == impl
    assert not any(hasattr(m, "_kvsieve_session") for m in llama.modules())
    out = llama(input_ids=prompt_ids, use_cache=True)
    assert not any(isinstance(layer, SieveLayer) for layer in out.cache.layers)


@pytest.mark.parametrize("name", COMPRESSING)
@torch.no_grad()
def test_decode_time_eviction_stays_under_budget_plus_chunk(llama, prompt_ids, name):
    """Every layer, every forward: a layer holds at most its own budget + one chunk (valid entries per head)."""
    budget, chunk = 32, 16
    seen = []  # (layer, entries per head attention saw, physical entries) for every attention call

    def record(module, args, output):
        layer = session.cache.layers[module.layer_idx]
        valid = layer.valid.float().sum(-1).mean().item() if layer.valid is not None else layer.physical_length
        seen.append((module.layer_idx, valid, layer.physical_length))

    hooks = [m.self_attn.register_forward_hook(record) for m in llama.model.layers]
    try:
        with kvsieve.attach(llama, get(name, window=8), kept=budget, mode="decode", chunk_size=chunk) as session:
            out = llama.generate(prompt_ids, max_new_tokens=12, do_sample=False)
    finally:
        for hook in hooks:
            hook.remove()
    layer_budgets = session.layer_budgets
    assert sum(layer_budgets) == budget * len(layer_budgets)  # same total as a uniform budget
    assert len(seen) >= len(layer_budgets) * (96 // chunk + 11)
    for idx, valid, physical in seen:
        assert valid <= layer_budgets[idx] + chunk, (name, idx, valid)
        if name != "adakv":  # AdaKV stores a layer at its widest head
            assert physical <= layer_budgets[idx] + chunk, (name, idx, physical)
    assert out.shape[1] == 96 + 12
    assert session.report.events >= 4  # at least after the chunks ending at 48, 64, 80 and 96 tokens


class OldestFirst(kvsieve.policies.Policy):
    """Keeps the oldest entries: without protection it would evict the newest chunk first."""

    name = "oldest_first"

    def score(self, signals):
        return -signals.positions.float()


@torch.no_grad()
def test_decode_time_eviction_keeps_the_latest_chunk_until_the_next_one(llama, prompt_ids):
    with kvsieve.attach(llama, OldestFirst(window=4), kept=32, mode="decode", chunk_size=16) as session:
        cache = llama(input_ids=prompt_ids, use_cache=True).cache
        question = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]])
        llama(input_ids=question, cache=cache, use_cache=True)
        for _, layer in sieve_layers(cache):
            kept = set(layer.positions[0, 0].tolist())
            assert set(range(96, 106)) <= kept  # the question is held until it has been answered
            assert layer.physical_length == 32
    assert session.report.events == 5  # chunks 3-6 (48, 64, 80, 96 tokens) and the question


def test_decode_mode_keeps_positional_arguments(llama):
    from kvsieve.engine.attach import Session, _forward_in_chunks

    calls = []

    def forward(*args, **kwargs):
        calls.append((args, kwargs["input_ids"].shape[1]))
        return type("Out", (), {"logits": None})()

    session = Session(get("knorm"), kvsieve.selection.Budget(kept=8), "decode", 4, 0)
    session.layer_budgets = [8]
    ids = torch.zeros(1, 10, dtype=torch.long)
    _forward_in_chunks(forward, ("positional",), {"input_ids": ids}, True, 10, session, [])
    assert [c[0] for c in calls] == [("positional",)] * 3 and [c[1] for c in calls] == [4, 4, 2]
    calls.clear()
    _forward_in_chunks(forward, (ids, "positional"), {}, True, 10, session, [])
    assert [c[0] for c in calls] == [("positional",)] * 3


@pytest.mark.parametrize("name", ["knorm", "random", "streaming_llm"])
@torch.no_grad()
def test_policies_without_a_window_compress_a_context_shorter_than_it(llama, prompt_ids, name):
    cache, session = prefill(llama, prompt_ids[:, :20], get(name), ratio=0.5)  # default window 64 > 20 tokens
    assert all(layer.physical_length == 10 for _, layer in sieve_layers(cache))


def test_decode_mode_logits_cover_every_position(llama, prompt_ids):
    with kvsieve.attach(llama, get("knorm"), kept=40, mode="decode", chunk_size=32):
        out = llama(input_ids=prompt_ids, use_cache=True)
    assert out.logits.shape[1] == 96


def test_unsupported_architecture_is_rejected():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        with kvsieve.attach(model, get("snapkv"), ratio=0.5):
            pass


def test_bad_inputs(llama, prompt_ids):
    with pytest.raises(TypeError, match="kvsieve Policy"):
        with kvsieve.attach(llama, "snapkv", ratio=0.5):
            pass
    with pytest.raises(ValueError, match="outside"):
        with kvsieve.attach(llama, get("snapkv"), ratio=1.5):
            pass
    with pytest.raises(ValueError, match="padded"):
        with kvsieve.attach(llama, get("snapkv", window=16), ratio=0.5):
            mask = torch.ones_like(prompt_ids)
            mask[0, :4] = 0
            llama(input_ids=prompt_ids, attention_mask=mask)
    with pytest.raises(ValueError, match="window 64 is larger than the context"):
        prefill(llama, prompt_ids[:, :20], get("snapkv", window=64), ratio=0.1)
    with pytest.raises(ValueError, match="above the context length 96"):
        prefill(llama, prompt_ids, get("knorm"), kept=200)
    with pytest.raises(ValueError, match="mode"):
        with kvsieve.attach(llama, get("knorm"), ratio=0.5, mode="stream"):
            pass
    with pytest.raises(ValueError, match="unknown policy 'snapkvv'"):
        get("snapkvv")
    with pytest.raises(ValueError, match="bad parameters"):
        get("snapkv", windw=3)


def test_policy_returning_a_bad_shape_is_rejected(llama, prompt_ids):
    from kvsieve.policy import Policy

    class Broken(Policy):
        name = "broken"

        def score(self, signals):
            return torch.zeros(signals.seq_len)

    with pytest.raises(ValueError, match="returned scores of shape"):
        prefill(llama, prompt_ids, Broken(window=8), ratio=0.5)


def test_fresh_cache_is_required(llama, prompt_ids):
    cache = DynamicCache(config=llama.config)
    llama(input_ids=prompt_ids, cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="fresh cache"):
        with kvsieve.attach(llama, get("knorm"), ratio=0.5):
            llama(input_ids=prompt_ids[:, :3], cache=cache, use_cache=True)


@torch.no_grad()
def test_accumulated_attention_matches_eager_attention_weights(prompt_ids, monkeypatch):
    monkeypatch.setattr("kvsieve.engine.attention._QUERY_BLOCK", 40)  # several query blocks
    model = tiny_model("qwen2")
    model.set_attn_implementation("eager")
    eager = model(input_ids=prompt_ids, output_attentions=True).attentions  # per layer (b, hq, q, k)
    cache, _ = prefill(model, prompt_ids, get("h2o", window=8), ratio=0.0)
    for idx, layer in sieve_layers(cache):
        b, hq, q, k = eager[idx].shape
        expected = eager[idx].sum(dim=2).view(b, layer.keys.shape[1], -1, k).sum(dim=2)
        torch.testing.assert_close(layer.attention_received, expected, atol=1e-4, rtol=1e-4)


class _IdTokenizer:
    """Decodes ids to text and declares one EOS id: enough for greedy_decode."""

    def __init__(self, eos: int | None) -> None:
        self.eos_token_id = eos

    def decode(self, ids, **_) -> str:
        return " ".join(str(i) for i in ids)


def test_a_settled_row_stops_and_the_others_decode_on_unchanged():
    from kvsieve.engine.generate import greedy_decode

    model = tiny_model("llama")
    prompts = torch.randint(1, 128, (3, 40), generator=torch.Generator().manual_seed(7))

    def decode(settled=None, steps=12):
        with kvsieve.attach(model, get("snapkv", window=8), ratio=0.5):
            out = model(input_ids=prompts, use_cache=True)
            return greedy_decode(model, _IdTokenizer(None), out.cache, out.logits[:, -1], steps, settled=settled)

    free = decode()
    calls = []

    def settled(row: int, tokens: list[int]) -> bool:  # row 0 is decided after 3 tokens, row 2 after 5
        calls.append((row, len(tokens)))
        return (row, len(tokens)) in ((0, 3), (2, 5))

    stopped = decode(settled)
    assert stopped == [free[0][:3], free[1], free[2][:5]] and len(free[1]) == 12
    assert (0, 4) not in calls and (1, 12) in calls  # a settled row is not asked again


def test_greedy_decode_refuses_positions_that_do_not_match_its_rows():
    from kvsieve.engine.generate import greedy_decode

    with pytest.raises(ValueError, match=r"one position per row \(2\), got shape \(3,\)"):
        greedy_decode(None, _IdTokenizer(None), None, torch.zeros(2, 8), 4, positions=torch.tensor([5, 6, 7]))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_batched_decode_drops_finished_rows_without_changing_the_others(arch, monkeypatch):
    from kvsieve.engine.generate import greedy_decode

    model = tiny_model(arch)
    prompts = torch.randint(1, 128, (3, 40), generator=torch.Generator().manual_seed(7))

    def decode(ids, eos, steps=12):
        with kvsieve.attach(model, get("snapkv", window=8), ratio=0.5):
            out = model(input_ids=ids, use_cache=True)
            return greedy_decode(model, _IdTokenizer(eos), out.cache, out.logits[:, -1], steps)

    free = [decode(prompts[i : i + 1], None)[0] for i in range(3)]
    # row 1 stops at the first token whose first occurrence is at step >= 2; the others wherever it first appears
    eos = next(t for i, t in enumerate(free[1]) if i >= 2 and free[1].index(t) == i)
    stop = free[1].index(eos)
    selected = []
    from transformers.cache_utils import DynamicCache

    original = DynamicCache.batch_select_indices
    monkeypatch.setattr(DynamicCache, "batch_select_indices",
                        lambda self, idx: (selected.append(idx.tolist()), original(self, idx))[1])
    batched = decode(prompts, eos)
    expected = [row[: row.index(eos)] if eos in row else row for row in free]
    assert batched == expected
    assert selected and len(batched[1]) == stop
