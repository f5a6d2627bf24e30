"""The CPU masked bucket path of ``engine/attention.stored_attention`` (issue 52): a bucket whose segments hold
different lengths, each masked past its own length, against attention written from scratch per (row, KV head).

The bundled models have at most 3 KV heads, so every bucket of the end-to-end tests is even (one length per bucket:
up to 4 buckets per layer); a bucket is uneven only with more than 4 segments of distinct lengths (batched decode
after growth, or more than 4 KV heads under kvzip or adakv). This builds such a store directly."""

import pytest
import torch

from kvsieve.engine.attention import stored_attention
from kvsieve.engine.cache import SieveLayer
from kvsieve.engine.ragged import RaggedStore

B, H, GROUPS, N, D = 2, 4, 2, 24, 8
# kept entries per (row, KV head): 8 distinct lengths in at most 4 buckets, so some bucket holds several lengths
LENGTHS = [[24, 23, 21, 18], [14, 13, 9, 8]]
SCALE = 0.35


def segments(seed: int):
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, D, generator=g)
    valid = torch.zeros(B, H, N, dtype=torch.bool)
    for r in range(B):
        for h in range(H):  # a head keeps a scattered subset of its entries, the first always among them
            kept = torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(N - 1, generator=g)])
            valid[r, h, kept[: LENGTHS[r][h]]] = True
    return keys, values, valid


def reference(query, keys, values, valid, new_keys, new_values) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """Plain attention, one (row, KV head) at a time over exactly its own entries (kept, then appended); query t of
    q sees entry j of a segment of length L iff j <= L - q + t. Also each entry's attention summed over the queries
    of its group. Returns (b, q, hq, d) and [row][head] -> (L,) attention received."""
    b, hq, q_len, d = query.shape
    out = torch.zeros(b, q_len, hq, values.shape[-1], dtype=torch.float64)
    received = []
    for r in range(b):
        received.append([])
        for h in range(H):
            k = torch.cat([keys[r, h][valid[r, h]], new_keys[r, h]]).double()
            v = torch.cat([values[r, h][valid[r, h]], new_values[r, h]]).double()
            length = k.shape[0]
            total = torch.zeros(length, dtype=torch.float64)
            for g in range(GROUPS):
                head = h * GROUPS + g
                for t in range(q_len):
                    logits = (query[r, head, t].double() @ k.T) * SCALE
                    logits[length - q_len + t + 1:] = -torch.inf
                    p = torch.softmax(logits, -1)
                    out[r, t, head] = p @ v
                    total += p
            received[r].append(total)
    return out, received


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("track", [False, True])
def test_an_uneven_bucket_matches_attention_over_each_segments_own_entries(q_len, track):
    keys, values, valid = segments(q_len)
    g = torch.Generator().manual_seed(10 + q_len)
    new_keys, new_values = torch.randn(B, H, q_len, D, generator=g), torch.randn(B, H, q_len, D, generator=g)
    query = torch.randn(B, H * GROUPS, q_len, D, generator=g)
    store = RaggedStore.from_dense(keys, values, torch.arange(N).expand(B, H, N), valid, spare=4,
                                   attention=torch.zeros(B, H, N) if track else None)
    layer = SieveLayer(track_attention=track)
    layer.store = store.append(new_keys, new_values, torch.full((B, H, q_len), N))
    lengths = layer.store.lengths.view(B, H)
    assert lengths.tolist() == [[n + q_len for n in row] for row in LENGTHS]
    assert not all(layer.store.bucket_even), "the path under test: a bucket whose segments differ in length"
    assert len(layer.store.buckets) <= 4

    got = stored_attention(query, layer, SCALE)
    expected, received = reference(query, keys, values, valid, new_keys, new_values)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    if track:
        store = layer.store
        for r in range(B):
            for h in range(H):
                s = r * H + h
                start, length = int(store.starts[s]), int(store.lengths[s])
                torch.testing.assert_close(store.attention[start:start + length].double(), received[r][h],
                                           atol=1e-5, rtol=1e-5)
