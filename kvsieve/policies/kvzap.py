"""``kvzap``: a per-layer surrogate of KVzip's scores, read off the cache in one pass.

KVzap (Jegou et al., NVIDIA kvpress, arXiv:2601.07891) trains, for every layer, a linear map or a small
MLP from the hidden state entering the layer to the log of KVzip's score of each KV head at that
position, and evicts the entries whose predicted score is low. KVzip (arXiv:2505.23416) pays a second
prefill to make the model repeat its context; the surrogate costs a few small matmuls per layer.

How this one differs from KVzap:

* **Inputs** (:data:`INPUTS`, recorded in the checkpoint). ``"hidden"`` is KVzap's: the hidden state
  entering the layer's attention (the decoder layer's normed input), which the engine keeps for policies
  that ask (``needs_hidden_states``, :mod:`kvsieve.engine.hidden_states`). ``"kv"`` reads only the cache:
  per position, the concatenation over the layer's KV heads of its **pre-RoPE key and its value**
  (``2 * kv_heads * head_dim`` numbers), both affine images of that hidden state (``W_k x + b_k``,
  ``W_v x + b_v``; Qwen3/Gemma3 add a per-head norm on the key), so a projection of KVzap's input onto a
  ``2 h d``-dimensional subspace: for SmolLM2-135M 384 of 576 hidden dims, for Qwen2.5-0.5B 256 of 896. The
  pre-RoPE keys are recovered exactly by rotating the cached keys back (:func:`pre_rope_keys`) with the
  rotary frequencies the checkpoint recorded from its model.
* **Alignment.** The heads' inputs are concatenated at the same cache index, so every KV head of a
  layer must hold the same positions: true of a prefill compression (the first one) and of a cache no
  per-head choice has touched. An entry's score depends on that entry alone (``intrinsic_scores``), so in
  decode mode the engine keeps each score with its entry and kvzap scores only the entries appended since
  the last eviction, which every head holds; the hidden-state variant stays prefill-only (the engine keeps
  hidden states until the first compression).
* **Budget.** KVzap prunes below a score threshold (kvpress ``ThresholdPress``); here the budget is a
  ratio, spent like KVzip's: ``allocation="global"`` (default) keeps the ``layers x kv_heads x kept``
  best predicted scores of the whole model, every head at least one entry, the chat template's header
  (``header`` tokens, recorded at training) always kept inside the budget, as KVzip does. The scores
  are log KVzip scores, one scale for every head and layer, hence ``comparable_across_*``.
* **Signals** (issue 51): a checkpoint fine-tuned by REINFORCE with ``signals = true`` also reads, per head,
  DistillCache's features of the observation window's queries
  (:data:`kvsieve.networks.kvzap_net.SIGNAL_FEATURES`), so its scores depend on the queries: it uses the
  window it was trained with (the checkpoint's ``window``), and they are not kept with the entries.
* **Training data** (:mod:`kvsieve.learn.kvzap_train`): generated RULER-style samples (seeds 5000+)
  and Python standard-library sources, not KVzap's Nemotron pretraining sample.

Checkpoints (one safetensors file, metadata key ``kvsieve_kvzap``) hold both variants, ``linear`` and
``mlp``, the per-layer input standardisation, the rotary frequencies, the header length, the held-out
losses and the model they were trained for (:class:`~kvsieve.networks.model_shape.ModelShape`: name, geometry and
config fingerprint); the policy refuses another model. ``kvzap(checkpoint=NAME)`` loads a shipped one
(:mod:`kvsieve.networks.shipped`), ``kvzap(checkpoint=PATH)`` a file or a ``kvsieve train --objective kvzap`` folder.
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace
from pathlib import Path

import torch

from kvsieve.networks.checkpoint import load_once
from kvsieve.networks.keep_features import extract
from kvsieve.networks.kvzap_net import (
    INPUTS,
    VARIANTS,
    KVzapNet,
    kvzap_inputs,
    load_kvzap,
    pre_rope_keys,
    rotary_tables,
    shared_positions,
)
from kvsieve.networks.model_shape import ModelShape
from kvsieve.networks.shipped import HOW_TO_TRAIN, checkpoint_name, resolve_checkpoint, shipped_names
from kvsieve.policy import Policy
from kvsieve.selection import ALLOCATIONS, Selection
from kvsieve.signals import Signals

__all__ = ["KVzap", "shipped_kvzap_for"]

_HOW_TO_TRAIN = HOW_TO_TRAIN["kvzap"]

# each checkpoint file version read once per process (load_once); a policy on another device moves a copy of its own
_LOADED: dict[tuple[str, int, int], tuple[KVzapNet, dict]] = {}


class KVzap(Policy):
    """Predicted log KVzip scores (see the module docstring).

    Args:
        checkpoint: shipped name (the model's), a checkpoint file or a training folder.
        variant: ``"mlp"`` or ``"linear"``; default: the checkpoint's (the lower held-out loss).
        allocation: ``"global"`` (KVzip's: one budget for every layer and head), ``"layer"`` or ``"uniform"``.
        model: the name the policy will run on, checked against the checkpoint's model.
        selection: overrides the selection ``allocation`` builds.
        window: the observation window of a checkpoint that reads signals (default: the one it was trained
            with); the surrogate alone reads no queries and ignores it.
    """

    name = "kvzap"
    uses_window = False
    intrinsic_scores = True  # a function of the entry's own key and value (or hidden state)
    comparable_across_heads = True  # log KVzip scores: one scale for every head ...
    comparable_across_layers = True  # ... and every layer (KVzip ranks them together)

    def __init__(self, checkpoint: str | None = None, variant: str | None = None, allocation: str = "global",
                 model: str | None = None, selection: Selection | None = None, window: int | None = None) -> None:
        if allocation not in ALLOCATIONS:
            raise ValueError(f"allocation {allocation!r} is not one of {', '.join(map(repr, ALLOCATIONS))}")
        path = resolve_checkpoint("kvzap", checkpoint)
        net, meta = load_once(_LOADED, path, load_kvzap)
        self._setup(net, meta, str(path), variant, allocation, selection, window)
        self._shared_net = True  # loaded once for every policy of this file (_load): never moved in place
        self.trained_for.refuse_name(model, self._what, _HOW_TO_TRAIN)

    @classmethod
    def from_network(cls, net: KVzapNet, meta: dict, variant: str | None = None, allocation: str = "global",
                     selection: Selection | None = None) -> KVzap:
        """A policy around a live network and its checkpoint metadata (REINFORCE fine-tuning), no file."""
        if allocation not in ALLOCATIONS:
            raise ValueError(f"allocation {allocation!r} is not one of {', '.join(map(repr, ALLOCATIONS))}")
        policy = cls.__new__(cls)
        policy._setup(net, meta, None, variant, allocation, selection)
        return policy

    def _setup(self, net: KVzapNet, meta: dict, checkpoint: str | None, variant: str | None, allocation: str,
               selection: Selection | None, window: int | None = None) -> None:
        self.net, self.meta = net, meta
        self._shared_net = False  # a live network (training) moves with its policy
        self.variant = variant or self.meta["variant"]
        if self.variant not in VARIANTS:
            raise ValueError(f"kvzap variant {self.variant!r} is not one of {', '.join(map(repr, VARIANTS))}")
        self.checkpoint = checkpoint
        self.trained_for = ModelShape(**self.meta["model"])
        self.header = int(self.meta["header"])
        rope = self.meta["rope"]
        shared: dict[tuple, torch.Tensor] = {}  # one tensor per distinct frequency list: layers share their tables
        self.inv_freq = [None if f is None else shared.setdefault(tuple(f), torch.tensor(f, dtype=torch.float32))
                         for f in rope["inv_freq"]]
        self.attention_scaling = [float(a) for a in rope["attention_scaling"]]
        self.allocation = allocation
        self.reads = self.meta.get("inputs", "kv")  # checkpoints written before hidden-state inputs read keys/values
        if self.reads not in INPUTS:
            raise ValueError(f"{self._what} reads inputs {self.reads!r}; this kvsieve knows {', '.join(INPUTS)}")
        self.needs_hidden_states = self.reads == "hidden"
        self.signals = self.net.config.signals
        if self.signals:  # scores that read the window's queries: neither intrinsic nor window-free
            self.uses_window, self.intrinsic_scores = True, False
            window = window if window is not None else int(self.meta.get("window", 64))
        self.overhead_seconds, self.overhead_calls = 0.0, 0
        self._last_tables: tuple | None = None  # (positions, inv_freq, (cos, sin)) of the last scored layer
        self._folded: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        super().__init__(selection=selection, window=window if window is not None else 1)

    @property
    def _what(self) -> str:
        return f"kvzap checkpoint {self.checkpoint!r}" if self.checkpoint else "kvzap network (in training)"

    @classmethod
    def content_paths(cls, checkpoint: str | None = None, **_) -> tuple[Path, ...]:
        """The checkpoint file: results of ``kvzap`` are keyed by its sha256."""
        return (resolve_checkpoint("kvzap", checkpoint),) if checkpoint is not None else ()

    @classmethod
    def named_params(cls, **params) -> dict:
        """A checkpoint given by the path of a shipped or named checkpoint's bytes, given by that name."""
        if not isinstance(params.get("checkpoint"), str):
            return params
        return {**params, "checkpoint": checkpoint_name("kvzap", params["checkpoint"]) or params["checkpoint"]}

    def default_selection(self) -> Selection:
        if self.allocation == "uniform":
            return Selection(sink=self.header)
        # KVzip's floor: one entry a head (the header, kept in every head, fills it)
        return Selection(sink=self.header, allocation=self.allocation, adaptive_floor=0.0)

    def check_model(self, model, name: str | None = None) -> None:
        """Refuse ``model`` unless it is the checkpoint's: same name (when given), geometry and config fingerprint."""
        self.trained_for.refuse_other(model, name, self._what, _HOW_TO_TRAIN)

    def check(self, signals: Signals) -> None:
        self.trained_for.refuse_geometry(signals, self._what, _HOW_TO_TRAIN)

    def _tables(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables of ``positions``; computed once per compression, not once per layer (every layer of
        a prefill holds the same positions, and the models' layers share their frequencies)."""
        hit = self._last_tables
        if hit is not None and hit[1] is inv_freq and hit[0].shape == positions.shape and torch.equal(hit[0],
                                                                                                      positions):
            return hit[2]
        tables = rotary_tables(positions, inv_freq)
        self._last_tables = (positions.clone(), inv_freq, tables)
        return tables

    def _folded_linear(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The linear variant with its standardisation folded in: ``((x - m) / s) @ W + c = x @ (W / s) + c -
        (m / s) @ W``, split into (h, d, H) key and value weights and an (H,) bias."""
        if layer not in self._folded:
            net, h = self.net, self.trained_for.num_kv_heads
            weight = net.linear_weight[layer] / net.std[layer][:, None]  # (2 h d, H)
            bias = net.linear_bias[layer] - (net.mean[layer] / net.std[layer]) @ net.linear_weight[layer]
            d = weight.shape[0] // (2 * h)
            self._folded[layer] = (weight[: h * d].reshape(h, d, -1), weight[h * d:].reshape(h, d, -1), bias)
        return self._folded[layer]

    def _follow_device(self, device: torch.device) -> None:
        """Move the network and frequencies to the cache's device (e.g. ``--device cuda``), once. A network shared
        with the other policies of its checkpoint file stays where it is: this policy moves a copy of its own."""
        if self.net.linear_weight.device != device:
            net = copy.deepcopy(self.net) if self._shared_net else self.net
            self.net, self._shared_net = net.to(device), False
            moved: dict[int, torch.Tensor] = {}  # layers that shared a frequency tensor keep sharing one
            self.inv_freq = [None if f is None else moved.setdefault(id(f), f.to(device)) for f in self.inv_freq]
            self._folded.clear()

    def _rotary(self, signals: Signals) -> tuple[torch.Tensor | None, float, torch.Tensor, tuple | None]:
        """One layer's checked setup: (inverse frequencies, attention scaling, shared positions, rotary tables)."""
        self.check(signals)
        self._follow_device(signals.keys.device)
        inv_freq, scaling = self.inv_freq[signals.layer_idx], self.attention_scaling[signals.layer_idx]
        positions = shared_positions(signals)
        return inv_freq, scaling, positions, None if inv_freq is None else self._tables(positions, inv_freq)

    def inputs(self, signals: Signals) -> torch.Tensor:
        """(b, n, D) the network's inputs for one layer: the hidden states, or :func:`kvzap_inputs` with this
        model's rotary."""
        if self.reads == "hidden":
            self.check(signals)
            if signals.hidden_states is None:
                raise ValueError(f"{self._what} reads the hidden states entering each layer, which this cache does "
                                 "not hold: run it through kvsieve.attach() in prefill mode (they are kept until "
                                 "the first compression, never after a per-head eviction)")
            self._follow_device(signals.hidden_states.device)
            return signals.hidden_states.float()
        inv_freq, scaling, _, tables = self._rotary(signals)
        return kvzap_inputs(signals, inv_freq, scaling, tables)

    def signal_inputs(self, signals: Signals) -> torch.Tensor | None:
        """(b, h, n, S) the signals a network that reads them takes for one layer, else None."""
        return extract(signals)[..., : self.signals] if self.signals else None

    @torch.no_grad()
    def score(self, signals: Signals) -> torch.Tensor:
        memo = signals.entry_scores
        if memo is None:
            return self._score_all(signals)
        fresh = torch.isnan(memo)
        n, new = signals.seq_len, int(fresh[0, 0].sum())
        if not (bool(fresh[..., n - new:].all()) and not bool(fresh[..., : n - new].any())):
            raise ValueError("kvzap's remembered scores leave unscored entries other than the latest of every head: "
                             "the engine appends new entries to every KV head, at the end")
        if new == 0:
            return memo
        tail = slice(n - new, n)  # the entries appended since the last eviction: every head holds them
        recent = replace(signals, keys=signals.keys[..., tail, :], values=signals.values[..., tail, :],
                         positions=signals.positions[..., tail], window_queries=signals.window_queries[..., -new:, :],
                         attention_received=None, hidden_states=None, entry_scores=None, extra={})
        scores = memo.clone()
        scores[..., tail] = self._score_all(recent)
        return scores

    def _score_all(self, signals: Signals) -> torch.Tensor:
        start = time.perf_counter()
        layer = signals.layer_idx
        # keys and values, linear: a matmul per head, no concatenated input (~2x cheaper than the network)
        if self.variant == "linear" and self.reads == "kv" and not self.signals:
            inv_freq, scaling, positions, tables = self._rotary(signals)
            keys = signals.keys.float() if inv_freq is None else pre_rope_keys(signals.keys, positions, inv_freq,
                                                                                scaling, tables)
            values = signals.values.float()
            key_weight, value_weight, bias = self._folded_linear(layer)
            out = bias.expand(keys.shape[0], keys.shape[2], -1)
            for head in range(keys.shape[1]):
                out = torch.baddbmm(out, keys[:, head], key_weight[head].expand(keys.shape[0], -1, -1))
                out = torch.baddbmm(out, values[:, head], value_weight[head].expand(keys.shape[0], -1, -1))
        else:
            out = self.net(self.inputs(signals), layer, self.variant, self.signal_inputs(signals))
        scores = out.transpose(1, 2)  # (b, h, n)
        self.overhead_seconds += time.perf_counter() - start
        self.overhead_calls += 1
        return scores

    def __repr__(self) -> str:
        return (f"KVzap(checkpoint={self.checkpoint!r}, variant={self.variant!r}, model={self.trained_for.name!r}, "
                f"selection={self.selection})")


def shipped_kvzap_for(model, name: str | None = None) -> KVzap | None:
    """The shipped surrogate trained for ``model`` (a live model, loaded under ``name`` when known), or None.

    Matched as every checkpoint refuses another model: name (aliases resolve), geometry and config fingerprint.
    """
    for shipped in shipped_names("kvzap"):
        surrogate = KVzap(checkpoint=shipped)
        try:
            surrogate.check_model(model, name)
        except ValueError:
            continue
        return surrogate
    return None
