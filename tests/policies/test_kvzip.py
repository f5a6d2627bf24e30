"""KVzip on tiny random models: reconstruction scores vs eager attention, allocation, cache, grid vs attach."""

import pytest
import torch
from conftest import TOKENIZER, CharTokenizer, sharpened, tiny_model

import kvsieve
from kvsieve.engine import reconstruct
from kvsieve.engine.cache import sieve_layers
from kvsieve.engine.reconstruct import ReconstructionPrompt, reconstruction_chunks, reconstruction_scores
from kvsieve.policies import FullCache, get
from kvsieve.prompt import build_prompt
from kvsieve.selection import Budget
from kvsieve.signals import Signals

CHUNK = 40  # context tokens per reconstruction forward: 96 (+ header) tokens take 3 chunks


PROMPT = ReconstructionPrompt.from_tokenizer(TOKENIZER)


@pytest.fixture
def ids(prompt_ids):
    """The chat template's header (5 tokens) followed by 96 random context tokens."""
    return torch.cat([torch.tensor([PROMPT.header]), prompt_ids], dim=1)


@torch.no_grad()
def full_cache(model, ids):
    with kvsieve.attach(model, FullCache(window=1), ratio=0.0):
        return model(input_ids=ids, use_cache=True).cache


@torch.no_grad()
def kvzip_cache(model, ids, ratio, **params):
    policy = get("kvzip", tokenizer=TOKENIZER, chunk_size=CHUNK, **params)
    with kvsieve.attach(model, policy, ratio=ratio) as session:
        out = model(input_ids=ids, use_cache=True)
    return out.cache, session


def kept_sets(layer) -> list[set[int]]:
    """Original positions each head of batch row 0 keeps (masked padding left out)."""
    positions = layer.positions[0]
    valid = layer.valid[0] if layer.valid is not None else torch.ones_like(positions, dtype=torch.bool)
    return [set(positions[h][valid[h]].tolist()) for h in range(positions.shape[0])]


def test_prompt_and_chunks_follow_the_authors_strings(ids):
    assert PROMPT.first == tuple(map(ord, "\n\nRepeat the previous context exactly."))
    assert PROMPT.next == tuple(map(ord, "\n\nRepeat the part of the previous context exactly, starting with"))
    assert PROMPT.header == tuple(map(ord, "\x02sys\x03")) and PROMPT.postfix == tuple(map(ord, "\x04\x05A:"))
    assert PROMPT.header_length(ids) == 5 and PROMPT.header_length(ids[:, 5:]) == 0
    plain = ReconstructionPrompt.from_tokenizer(CharTokenizer(template=False))
    assert plain.header == () and plain.postfix == (ord("\n"),)
    chunks = reconstruction_chunks(ids, PROMPT, 5, 101, CHUNK)
    assert [(c.start, c.end) for c in chunks] == [(5, 45), (45, 85), (85, 101)]
    first, second = chunks[0].input_ids[0].tolist(), chunks[1].input_ids[0].tolist()
    assert first == [*PROMPT.first, *PROMPT.postfix, *ids[0, 5:45].tolist()]
    assert second == [*PROMPT.next, *ids[0, 37:45].tolist(), *PROMPT.postfix, *ids[0, 45:85].tolist()]
    # a question at the end (question-aware mode) is not repeated
    assert reconstruction_chunks(ids, PROMPT, 5, 90, CHUNK)[-1].end == 90




@pytest.mark.parametrize("sharp", [False, True])
@pytest.mark.parametrize("normalization", ["chunk", "full"])
@torch.no_grad()
def test_scores_equal_the_max_of_eager_attention_weights(ids, normalization, sharp, monkeypatch):
    """Per entry: max over the group's query heads and the reconstruction queries of the eager softmax."""
    monkeypatch.setattr(reconstruct, "QUERY_BLOCK", 16)  # several query blocks per chunk
    prepare = sharpened if sharp else (lambda m: m)
    model = prepare(tiny_model("llama"))
    cache = full_cache(model, ids)
    keys_before = [layer.keys for _, layer in sieve_layers(cache)]
    rec = reconstruction_scores(model, cache, ids, PROMPT, chunk_size=CHUNK, normalization=normalization)
    assert (rec.header, rec.chunks) == (5, 3)
    # the cache itself is untouched: same tensors, nothing of the reconstruction appended
    assert [layer.keys for _, layer in sieve_layers(cache)] == keys_before
    assert all(layer.seen == 101 and layer.physical_length == 101 for _, layer in sieve_layers(cache))

    eager = prepare(tiny_model("llama"))
    eager.set_attn_implementation("eager")
    n, header = ids.shape[1], rec.header
    expected = [torch.zeros(1, 2, n) for _ in range(3)]
    for chunk in reconstruction_chunks(ids, PROMPT, header, n, CHUNK):
        q = chunk.input_ids.shape[1]
        attentions = eager(input_ids=torch.cat([ids, chunk.input_ids], dim=1), output_attentions=True).attentions
        for layer, weights in enumerate(attentions):  # (1, 4 query heads, n + q, n + q)
            weights = weights[:, :, n:, :]  # the reconstruction queries
            if normalization == "full":
                got = weights[..., :n].reshape(1, 2, 2, q, n).amax(dim=(2, 3))
                expected[layer] = torch.maximum(expected[layer], got)
            else:  # softmax restricted to header + repeated chunk + reconstruction tokens = renormalised weights
                columns = [*range(header), *range(chunk.start, chunk.end), *range(n, n + q)]
                sub = weights[..., columns]
                sub = sub / sub.sum(dim=-1, keepdim=True)
                m = chunk.end - chunk.start
                expected[layer][..., chunk.start : chunk.end] = (
                    sub[..., header : header + m].reshape(1, 2, 2, q, m).amax(dim=(2, 3)))
    for layer in range(3):
        torch.testing.assert_close(rec.scores[layer], expected[layer], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_recording_leaves_the_attention_it_wraps_unchanged(dtype):
    """kvzip_attention returns plain causal attention and leaves its query as it was, in every dtype.

    The query arrives as a strided view (projection, transpose, RoPE); in float32 ``.float()`` is that
    same tensor, so an in-place scale while recording changed the forward's own attention.
    """
    b, hq, h, q_len, n, d = 1, 4, 2, 6, 10, 16
    g = torch.Generator().manual_seed(3)
    query = (3 * torch.randn(b, q_len, hq, d, generator=g)).to(dtype).transpose(1, 2)  # (b, hq, q, d), strided
    key = (3 * torch.randn(b, h, n + q_len, d, generator=g)).to(dtype)
    value = torch.randn(b, h, n + q_len, d, generator=g).to(dtype)
    before = query.clone()
    module = torch.nn.Module()
    module.layer_idx, module.is_causal, module.num_key_value_groups = 0, True, hq // h
    state = reconstruct._State(n, 2, 2, n, "chunk", {0: torch.zeros(b, h, n)})
    module._kvsieve_kvzip = state
    out, _ = reconstruct.kvzip_attention(module, query, key, value, None, scaling=d**-0.5)
    assert torch.equal(query, before)
    assert bool(state.scores[0][..., 2:n].gt(0).all())  # it did record
    # reference: softmax(q k^T / sqrt(d)) v in float64, query i sees the n cached keys and new keys <= i
    qf, kf, vf = (t.double().repeat_interleave(hq // h, dim=1) if t is not query else t.double()
                  for t in (query, key, value))
    logits = qf @ kf.transpose(-1, -2) * d**-0.5
    future = torch.arange(n + q_len)[None, :] > (n + torch.arange(q_len))[:, None]
    expected = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1) @ vf  # (b, hq, q, d)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.double(), expected.transpose(1, 2), **tol)


@pytest.mark.parametrize("allocation", ["global", "uniform"])
@pytest.mark.parametrize("ratio", [0.5, 0.8])
@torch.no_grad()
def test_kept_entries_are_the_top_scores(ids, allocation, ratio):
    model = tiny_model("llama")
    rec = reconstruction_scores(model, full_cache(model, ids), ids, PROMPT, chunk_size=CHUNK)
    cache, _ = kvzip_cache(model, ids, ratio, allocation=allocation)
    n = ids.shape[1]
    kept = Budget(ratio=ratio).resolve(n)
    scores = {layer: s[0].clone() for layer, s in rec.scores.items()}
    for s in scores.values():
        s[:, : rec.header] = float("inf")  # the template header is always kept
    got = {idx: kept_sets(layer) for idx, layer in sieve_layers(cache)}
    if allocation == "uniform":
        for layer, s in scores.items():
            assert got[layer] == [set(torch.topk(s[h], kept).indices.tolist()) for h in range(2)]
    else:  # the 3 layers x 2 heads x kept best entries of the whole model
        ranked = sorted(((-float(s[h, i]), layer, h, i) for layer, s in scores.items() for h in range(2)
                         for i in range(n)))
        expected = {(layer, h): set() for layer in scores for h in range(2)}
        for _, layer, h, i in ranked[: 3 * 2 * kept]:
            expected[layer, h].add(i)
        assert got == {layer: [expected[layer, h] for h in range(2)] for layer in scores}
        sizes = [len(s) for layer in got.values() for s in layer]
        assert len(set(sizes)) > 1  # really non-uniform across heads and layers


@torch.no_grad()
def test_cache_holds_the_budget_no_reconstruction_tokens_and_decodes(ids):
    model = tiny_model("llama")
    n, kept = ids.shape[1], Budget(ratio=0.5).resolve(ids.shape[1])
    nxt = torch.tensor([[5, 7, 9]])
    for allocation in ("uniform", "global"):
        cache, session = kvzip_cache(model, ids, 0.5, allocation=allocation)
        layers = sieve_layers(cache)
        if allocation == "uniform":
            assert all(layer.physical_length == kept and layer.valid is None for _, layer in layers)
        else:
            assert sum(len(s) for _, layer in layers for s in kept_sets(layer)) == 3 * 2 * kept
            assert session.report.bytes_after == sum(layer.nbytes() for _, layer in layers)
        assert all(layer.seen == n and int(layer.positions.max()) < n for _, layer in layers)
        assert cache.get_seq_length() == n
        # the pruned cache answers exactly as the full cache with the evicted entries masked out
        masked = full_cache(model, ids)
        for idx, layer in layers:
            keep = torch.zeros_like(masked.layers[idx].positions, dtype=torch.bool)
            for h, positions in enumerate(kept_sets(layer)):
                keep[0, h, sorted(positions)] = True
            masked.layers[idx].valid = keep
            masked.layers[idx].grow_in_place = False  # stays dense: masked sdpa, the independent path
        with kvsieve.attach(model, FullCache(window=1), ratio=0.0):
            a = model(input_ids=nxt, cache=cache, use_cache=True).logits
            b = model(input_ids=nxt, cache=masked, use_cache=True).logits
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
        assert cache.get_seq_length() == n + 3
        with kvsieve.attach(model, get("kvzip", tokenizer=TOKENIZER, allocation=allocation), ratio=0.5):
            out = model.generate(ids, max_new_tokens=6, do_sample=False)
        assert out.shape[1] == n + 6


@torch.no_grad()
def test_grid_and_attach_keep_the_same_entries(monkeypatch):
    from kvsieve.engine import prune, reader
    from kvsieve.harness.evaluate import evaluate_sample
    from kvsieve.policies.label import Point
    from kvsieve.tasks.sample import Sample

    model = tiny_model("llama")
    text = "The code word is kiwi. " * 4 + "Some more filler text follows here, and then the end."
    sample = Sample(id="s0", task="toy", context=text, question="What is the code word?", answer_prefix="It is",
                    answers=["kiwi"], max_new_tokens=4, length=128, seed=0, metric="string_match_all")
    cells = [Point("kvzip(chunk_size=40)", 0.5), Point("kvzip(chunk_size=40, allocation='uniform')", 0.5),
             Point("kvzip(chunk_size=40)", 0.75), Point("kvzip(chunk_size=40)", 0.5, True), Point("full", 0.0)]
    pruned, rebuilt = {}, []
    compress, scores = prune.compress_with_reconstruction, reader.reconstruction_scores

    def recording_compress(model, cache, ids, policy, budget, protected, report, reconstruction):
        out = compress(model, cache, ids, policy, budget, protected, report, reconstruction=reconstruction)
        pruned[(policy.allocation, budget.ratio, protected > 0)] = {i: kept_sets(x) for i, x in sieve_layers(cache)}
        return out

    def counting_scores(*args, **kwargs):
        rebuilt.append(scores(*args, **kwargs))
        return rebuilt[-1]

    monkeypatch.setattr(prune, "compress_with_reconstruction", recording_compress)
    monkeypatch.setattr(reader, "reconstruction_scores", counting_scores)
    results = evaluate_sample(model, TOKENIZER, sample, cells)
    assert len(rebuilt) == 2  # one per sample and question-awareness, shared by every ratio and allocation
    for result in results[:3]:  # the reconstruction's seconds are in each kvzip cell's prefill time
        assert result.prefill_seconds >= rebuilt[0].seconds > 0

    prompt = build_prompt(TOKENIZER, sample.context, sample.question, sample.answer_prefix)
    question = prompt.question_ids.shape[1]
    for (allocation, ratio, aware), grid_kept in pruned.items():
        policy = get("kvzip", tokenizer=TOKENIZER, chunk_size=40, allocation=allocation)
        ids = torch.cat([prompt.context_ids, prompt.question_ids], 1) if aware else prompt.context_ids
        with kvsieve.attach(model, policy, ratio=ratio, protected_tail=question if aware else 0):
            cache = model(input_ids=ids, use_cache=True).cache
        assert {i: kept_sets(x) for i, x in sieve_layers(cache)} == grid_kept, (allocation, ratio, aware)
    naive = evaluate_sample(model, TOKENIZER, sample, cells[:4], shared=False)  # generate() under attach
    for a, b in zip(results, naive):
        assert (a.kept_tokens, a.cache_bytes) == (b.kept_tokens, b.cache_bytes)


@torch.no_grad()
def test_gemma3_sliding_layers_run_through_the_reconstruction(ids):
    model = tiny_model("gemma3")
    cache, session = kvzip_cache(model, ids, 0.5)
    assert [idx for idx, _ in sieve_layers(cache)] == [1]  # only the full-attention layer is compressed
    assert sum(len(s) for s in kept_sets(cache.layers[1])) == 1 * 2 * Budget(ratio=0.5).resolve(ids.shape[1])
    with kvsieve.attach(model, get("kvzip", tokenizer=TOKENIZER, chunk_size=CHUNK), ratio=0.5):
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 4


def test_bad_inputs_give_clear_errors(llama, ids):
    with pytest.raises(ValueError, match="cannot evict in decode mode"):
        with kvsieve.attach(llama, get("kvzip", tokenizer=TOKENIZER), ratio=0.5, mode="decode"):
            pass
    with pytest.raises(ValueError, match="needs its tokenizer"):
        with kvsieve.attach(llama, get("kvzip"), ratio=0.5):  # a random model names no tokenizer folder
            llama(input_ids=ids, use_cache=True)
    with pytest.raises(ValueError, match="allocation 'layer'"):
        get("kvzip", allocation="layer")
    with pytest.raises(ValueError, match="normalization"):
        get("kvzip", normalization="exact")
    with pytest.raises(ValueError, match="chunk_size"):
        get("kvzip", chunk_size=0)
    signals = Signals(keys=torch.zeros(1, 2, 8, 4), values=torch.zeros(1, 2, 8, 4),
                      window_queries=torch.zeros(1, 4, 1, 4), positions=torch.arange(8).expand(1, 2, 8),
                      layer_idx=0, num_layers=1, scaling=0.5)
    with pytest.raises(ValueError, match="reconstruction forward"):
        get("kvzip").score(signals)
    cache, _ = kvzip_cache(llama, ids, 0.5)
    with pytest.raises(ValueError, match="whole context cache"):
        reconstruction_scores(llama, cache, ids, PROMPT)
    with pytest.raises(ValueError, match="below the 5 chat-template header"):
        with kvsieve.attach(llama, get("kvzip", tokenizer=TOKENIZER), kept=4):
            llama(input_ids=ids, use_cache=True)
    embeds = llama.get_input_embeddings()(ids)
    with pytest.raises(ValueError, match="not embeddings"):
        with kvsieve.attach(llama, get("kvzip", tokenizer=TOKENIZER), ratio=0.5):
            llama(inputs_embeds=embeds, use_cache=True)
