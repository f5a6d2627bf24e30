"""Decode-time eviction in the running batch: a row at a decode-time point held at a cap while it generates.

A decode-time point (``SPEC@decodeCeE``) reads its prompt under eviction (``serve/decode_prefill.py``, as
``attach(mode="decode")`` does in the grid) and then evicts every ``E`` generated tokens back to the same per-layer
budgets. Once its prompt is read the row joins the decode batch held at a **cap**:

* its **budget** per layer: what ``attach(mode="decode")`` evicts the layer back to (the ratio's share of the whole
  context, spread over layers by the policy's selection), carried with the cache's layers (``SieveLayer.budget``);
* its **room**: ``E`` entries a segment (one KV head of one layer) may grow before the next eviction.

Once a row has taken ``E`` tokens since its join or its last eviction, the scheduler evicts it back to its budgets
before the step that would take one more (:func:`evict_rows`): the row is taken out of the batch, its policy scores
it (``compress_cache`` in decode mode: a layer over its budget keeps its best entries, the newest always; the policy's
allocation moves the layer's budget between its heads, never between layers), each segment is laid out with exactly
``E`` entries of room, and the batch is stacked again (one rebuild for all the rows due at that step). That is the
grid's eviction of a generated token, entry for entry: the same budgets, the same protected newest entry, after the
same ``E`` tokens. Each row counts its own tokens, so what it keeps never depends on what else runs.

**What the row can ever hold** (:attr:`RowCap.charge`, bytes) is therefore the larger of its layout when it joined
(every segment its entries plus ``E``) and ``e x heads x (budget + E)`` summed over layers (``e`` one entry's key
and value): after an eviction a layer holds at most ``heads x budget`` entries, and the layout gives every segment
exactly ``E`` of room, no rounding. The scheduler charges that from the join on, checks every eviction's result
against it, and so the sum of charges stays an upper bound of what the batch allocates. Not charged: the copies an
eviction makes while it works (the rows taken out, the batch stacked again), as the batch's other rebuilds are not.

Which policies can (:func:`evicts_in_decode`; the server refuses a decode-time point of any other at start): those
whose scores read what the batch keeps: keys, values, positions, the last queries (the stacked batch keeps the window
of every row, cut to the shortest when a row joins) and an intrinsic policy's remembered scores (kvzap: scored as they
are appended, new entries scored when evicted). Not KVzip (it repeats the whole context), nor policies reading hidden
states, accumulated attention or query statistics, which the batch does not collect; nor a selection giving a share
of the budget to recent entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from kvsieve.engine.cache import (
    cache_allocated_bytes,
    clone_cache,
    reserve_room,
    sieve_layers,
    stack_caches,
)
from kvsieve.engine.compress import compress_cache
from kvsieve.policy import Policy

__all__ = ["BudgetViolation", "RowCap", "evict_rows", "evicts_in_decode", "hold_room", "row_cap",
           "stack_rows"]

NEWEST = 1  # the newest entry (its token's query reads it next step) is protected at an eviction


def evicts_in_decode(policy: Policy) -> bool:
    """Whether ``policy`` can evict from the running batch (module docstring)."""
    return bool(policy.evicts and not policy.needs_reconstruction and not policy.needs_hidden_states
                and not policy.needs_accumulated_attention and not policy.needs_query_stats
                and policy.selection.recent_share == 0)


@dataclass(frozen=True)
class RowCap:
    """A row's decode-time cap: each cache layer's budget (mean entries per head; 0 for a layer kvsieve does not
    hold), its room, and the most bytes it can ever allocate from its join on."""

    layer_budgets: list[int]
    room: int
    charge: int


def row_cap(cache: DynamicCache, policy: Policy, room: int) -> RowCap:
    """The cap of a one-row ``cache`` whose prompt was read at a decode-time point (each layer's ``budget`` set by
    its read) and laid out with ``room`` (module docstring)."""
    if isinstance(room, bool) or not isinstance(room, int) or room < 1:
        raise ValueError(f"room must be a positive number of entries, got {room!r}")
    budgets = [0] * len(cache.layers)
    evicted = 0
    for idx, layer in sieve_layers(cache):
        if not layer.physical_length:
            continue
        if layer.budget is None:
            raise ValueError(f"layer {idx} has no decode-time budget: a row that evicts while it decodes is read at "
                             "a decode-time point (serve/decode_prefill.py), which sets it")
        budgets[idx] = layer.budget
        evicted += layer.entry_bytes() * layer.num_heads() * (budgets[idx] + room)
    return RowCap(budgets, room, max(cache_allocated_bytes(cache), evicted))


def hold_room(cache: DynamicCache, room: int) -> DynamicCache:
    """Lay every kvsieve layer of ``cache`` out with exactly ``room`` entries of room after each segment (segments
    of equal need share a bucket; nothing is rounded up). Returns ``cache``."""
    reserve_room(cache, 0)  # dense layers into stores
    for _, layer in sieve_layers(cache):
        store = layer.store
        if store is None:
            continue
        needs = store.lengths + room
        groups = [(int(need), (needs == need).nonzero().flatten()) for need in needs.unique()]
        layer.store = store.repacked(groups=groups)
    return cache


def _true_positions(cache: DynamicCache, position: int, fed: int) -> None:
    """Write the original positions of the ``fed`` entries a one-row ``cache`` took in the batch (the batch's layers
    number appended entries by one shared count, not by each row's own position), ``position`` the next one."""
    for _, layer in sieve_layers(cache):
        layer.seen = position  # the next position, which a policy may read
        store = layer.store
        if store is None or fed == 0:
            continue
        device = store.positions.device
        step = torch.arange(fed, device=device)
        index = ((store.device_starts + store.device_lengths - fed)[:, None] + step[None, :]).reshape(-1)
        store.positions.index_copy_(0, index, (position - fed + step).repeat(store.lengths.numel()))


@torch.no_grad()
def evict_rows(batch: DynamicCache, rows: list[tuple[Policy, RowCap] | None], positions: list[int],
               fed: list[int]) -> tuple[DynamicCache | None, list[int], dict[int, Exception]]:
    """The batch with every row that has a ``(policy, cap)`` evicted back to its cap (``None``: left as it is).

    Returns the new batch (None: no row left), ``order`` (the old index of each of its rows: the rows left as they
    were first, taken out as one block, then the evicted ones) and the rows whose eviction failed (old index -> the
    error: a policy that raised, or a layout past the row's charge, never expected), which it no longer holds.
    ``positions[i]`` is row i's next position, ``fed[i]`` the tokens it took since its join or its last eviction."""
    windows = {idx: (layer.recent_queries, layer.window) for idx, layer in sieve_layers(batch)}
    rest = [i for i, row in enumerate(rows) if row is None]
    parts, order, failed = [], list(rest), {}
    if rest:
        block = clone_cache(batch)
        block.batch_select_indices(torch.tensor(rest))
        parts.append(block)
    for i, row in enumerate(rows):
        if row is None:
            continue
        policy, cap = row
        one = clone_cache(batch)
        one.batch_select_indices(torch.tensor([i]))
        try:
            _true_positions(one, positions[i], fed[i])
            compress_cache(one, policy, protected_tail=NEWEST, layer_budgets=cap.layer_budgets)
            hold_room(one, cap.room)
            allocated = cache_allocated_bytes(one)
            if allocated > cap.charge:
                raise BudgetViolation(f"the eviction's layout allocates {allocated} bytes, more than the row's cap of "
                                      f"{cap.charge}")
        except Exception as err:  # noqa: BLE001 - one row's failure, never the batch's
            failed[i] = err
            continue
        parts.append(one)
        order.append(i)
    if not parts:
        return None, [], failed
    stacked = stack_caches(parts, keep_scores=True)
    index = torch.tensor(order)
    for idx, layer in sieve_layers(stacked):
        queries, window = windows[idx]
        layer.recent_queries = None if queries is None else queries[index.to(queries.device)]
        layer.window = window
    return stacked, order, failed


def stack_rows(batch: DynamicCache | None, row: DynamicCache) -> DynamicCache:
    """``row`` (one request, its prompt just read) appended to ``batch``, remembered scores and the last queries of
    every row kept (the window cut to the shortest of the two, so every row has the same number)."""
    if batch is None:
        stacked = stack_caches([row], keep_scores=True)
        for (_, layer), (_, old) in zip(sieve_layers(stacked), sieve_layers(row)):
            layer.recent_queries = old.recent_queries
        return stacked
    stacked = stack_caches([batch, row], keep_scores=True)
    old = dict(sieve_layers(batch))
    new = dict(sieve_layers(row))
    for idx, layer in sieve_layers(stacked):
        a, b = old[idx].recent_queries, new[idx].recent_queries
        layer.window = max(old[idx].window, new[idx].window)
        if a is None or b is None:
            layer.recent_queries = None
            continue
        width = min(a.shape[-2], b.shape[-2])
        layer.recent_queries = torch.cat([a[..., a.shape[-2] - width:, :], b[..., b.shape[-2] - width:, :]])
    return stacked


class BudgetViolation(RuntimeError):
    """A charge or a layout that would break the budget invariant (never expected: a bug, failed loudly)."""
