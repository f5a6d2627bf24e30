"""``learned``: the DistillCache policy network as a kvsieve policy.

DistillCache (the paper's abstract) learns "a lightweight policy network using rich internal
model signals" to decide what to evict. Here that network (:mod:`kvsieve.networks.keep_net`) scores every
cached entry of a layer from its features (:mod:`kvsieve.networks.keep_features`); like every policy, which
entries survive is its :class:`~kvsieve.selection.Selection`'s business: top-k per head, with the
observation window (the last ``window`` entries, whose queries the features read) always kept. So it
runs in prefill compression and in decode-time eviction (``kvsieve.attach(..., mode="decode")``)
unchanged.

``learned(checkpoint=PATH)`` loads a checkpoint written by ``kvsieve train`` (a file, or a run folder
holding ``policy.safetensors``); ``learned(checkpoint=NAME)`` loads a shipped one
(:data:`kvsieve.networks.shipped.SHIPPED`).
A checkpoint is tied to the model it was trained for, since features such as the layer embedding mean
nothing on another model. It records the model's name, its cache geometry and a fingerprint of its config
(:mod:`kvsieve.networks.fingerprint`), and the policy refuses a mismatch wherever it meets a model:
``model=NAME`` at construction compares names (aliases resolve); :meth:`LearnedPolicy.check_model`
compares a live model's config fingerprint and geometry (and its name, when given), which whoever runs the
policy on a model calls before the first forward (the harness, ``kvsieve eval``); and every scored layer
compares the cache's geometry. A checkpoint written before fingerprints (none of the shipped ones: their
metadata was given the fingerprints of the bundled models' configs) is checked on name and geometry only.
``overhead_seconds`` / ``overhead_calls`` report the time spent in :meth:`score` (features +
network), the policy's own per-step cost.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from kvsieve.networks.checkpoint import load_checkpoint, load_once
from kvsieve.networks.keep_features import extract
from kvsieve.networks.keep_net import KeepNet, NetConfig
from kvsieve.networks.model_shape import ModelShape
from kvsieve.networks.shipped import HOW_TO_TRAIN, checkpoint_name, resolve_checkpoint
from kvsieve.policy import Policy
from kvsieve.selection import ALLOCATIONS, Selection
from kvsieve.signals import Signals

__all__ = ["LearnedPolicy"]

_HOW_TO_TRAIN = HOW_TO_TRAIN["learned"]

# each checkpoint file version read once per process (load_once); the policies share the network in eval mode
_LOADED: dict[tuple[str, int, int], tuple[KeepNet, dict]] = {}


def _read(path: Path) -> tuple[KeepNet, dict]:
    loaded = load_checkpoint(path)
    net = KeepNet(NetConfig(**loaded.meta["net"]))
    try:
        net.load_state_dict(loaded.group("net"), strict=True)
    except RuntimeError as err:
        raise ValueError(f"checkpoint {str(path)!r} does not hold the network its metadata describes: "
                         f"{err}") from err
    return net.eval(), loaded.meta


class LearnedPolicy(Policy):
    """Keep scores from a trained :class:`~kvsieve.networks.keep_net.KeepNet`; window kept by the selection."""

    name = "learned"

    def __init__(self, checkpoint: str | None = None, model: str | None = None, window: int | None = None,
                 allocation: str = "uniform", **kwargs) -> None:
        if allocation not in ALLOCATIONS:
            raise ValueError(f"allocation {allocation!r} is not one of {list(ALLOCATIONS)}")
        self.allocation = allocation
        path = resolve_checkpoint("learned", checkpoint)
        net, meta = load_once(_LOADED, path, _read)
        self.checkpoint = str(path)
        self._setup(net, ModelShape(**meta["model"]), window or int(meta["window"]), **kwargs)
        self.trained_for.refuse_name(model, f"learned policy checkpoint {self.checkpoint!r}", _HOW_TO_TRAIN)

    @classmethod
    def from_network(cls, net: KeepNet, trained_for: ModelShape, window: int, **kwargs) -> LearnedPolicy:
        """A policy around a live network (training), with no checkpoint file."""
        policy = cls.__new__(cls)
        policy.checkpoint, policy.allocation = None, "uniform"
        policy._setup(net, trained_for, window, **kwargs)
        return policy

    def _setup(self, net: KeepNet, trained_for: ModelShape, window: int, **kwargs) -> None:
        self.net = net.eval()
        self.trained_for = trained_for
        self.overhead_seconds = 0.0
        self.overhead_calls = 0
        super().__init__(window=window, **kwargs)

    def default_selection(self) -> Selection:
        # keep logits of one shared network; moved across heads or layers they are standardised per head
        # first, since nothing in training made their scales comparable
        if self.allocation == "uniform":
            return Selection(recent=self.window)
        return Selection(recent=self.window, allocation=self.allocation, normalization="zscore")

    @property
    def overhead_ms_per_call(self) -> float:
        """Mean milliseconds per :meth:`score` call (one layer's features and network forward)."""
        return 1000 * self.overhead_seconds / max(self.overhead_calls, 1)

    @classmethod
    def content_paths(cls, checkpoint: str | None = None, **_) -> tuple[Path, ...]:
        return (resolve_checkpoint("learned", checkpoint),) if checkpoint is not None else ()

    @classmethod
    def named_params(cls, **params) -> dict:
        """A checkpoint given by the path of a shipped or named checkpoint's bytes, given by that name."""
        if not isinstance(params.get("checkpoint"), str):
            return params
        return {**params, "checkpoint": checkpoint_name("learned", params["checkpoint"]) or params["checkpoint"]}

    def check_model(self, model, name: str | None = None) -> None:
        """Refuse ``model`` unless it is the checkpoint's: same name (aliases resolve), geometry and config
        fingerprint."""
        self.trained_for.refuse_other(model, name, f"learned policy {self.checkpoint or '(in training)'}",
                                      _HOW_TO_TRAIN)

    def check(self, signals: Signals) -> None:
        """Refuse a cache whose geometry differs from the checkpoint's model."""
        self.trained_for.refuse_geometry(signals, f"learned policy {self.checkpoint or '(in training)'}",
                                         _HOW_TO_TRAIN)

    @torch.no_grad()
    def logits(self, signals: Signals) -> tuple[torch.Tensor, torch.Tensor]:
        """(features (b, h, n, F), keep logits (b, h, n)) of one layer."""
        self.check(signals)
        features = extract(signals)
        return features, self.net(features)

    def score(self, signals: Signals) -> torch.Tensor:
        start = time.perf_counter()
        scores = self.logits(signals)[1]
        self.overhead_seconds += time.perf_counter() - start
        self.overhead_calls += 1
        return scores

    def __repr__(self) -> str:
        return f"LearnedPolicy(checkpoint={self.checkpoint!r}, model={self.trained_for.name!r}, window={self.window})"
