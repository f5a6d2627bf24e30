"""``learned``: the DistillCache policy network as a kvsieve policy.

DistillCache (the paper's abstract) learns "a lightweight policy network using rich internal
model signals" to decide what to evict. Here that network (:mod:`kvsieve.learn.network`) scores every
cached entry of a layer from its features (:mod:`kvsieve.learn.features`); like every policy, which
entries survive is its :class:`~kvsieve.selection.Selection`'s business: top-k per head, with the
observation window (the last ``window`` entries, whose queries the features read) always kept. So it
runs in prefill compression and in decode-time eviction (``kvsieve.attach(..., mode="decode")``)
unchanged.

``learned(checkpoint=PATH)`` loads a checkpoint written by ``kvsieve train`` (a file, or a run folder
holding ``policy.safetensors``); ``learned(checkpoint=NAME)`` loads a shipped one (:data:`SHIPPED`).
A checkpoint is tied to the model it was trained for, since features such as the layer embedding mean
nothing on another model. It records the model's name, its cache geometry and a fingerprint of its config
(:mod:`kvsieve.learn.fingerprint`), and the policy refuses a mismatch wherever it meets a model:
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
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvsieve.bundled import canonical_name
from kvsieve.learn.checkpoint import load_checkpoint
from kvsieve.learn.features import extract
from kvsieve.learn.fingerprint import config_fields, fields_fingerprint, text_config
from kvsieve.learn.network import KeepNet, NetConfig
from kvsieve.policy import Policy
from kvsieve.selection import ALLOCATIONS, Selection
from kvsieve.signals import Signals

__all__ = ["SHIPPED", "ModelShape", "LearnedPolicy", "resolve_checkpoint", "shipped_names"]

CHECKPOINT_DIR = Path(__file__).parent / "checkpoints"
# shipped name (the model it was trained for; aliases work too) -> file in CHECKPOINT_DIR.
# How each was trained (command, wall time) is in the README, "Learn", and in the file's metadata.
SHIPPED: dict[str, str] = {
    "smollm2-135m-instruct": "smollm2-135m-instruct.safetensors",
    "qwen2.5-coder-0.5b-instruct": "qwen2.5-coder-0.5b-instruct.safetensors",
}

_HOW_TO_TRAIN = ("train one with `kvsieve train --model MODEL --out DIR` and use "
                 "learned(checkpoint='DIR/policy.safetensors')")


def shipped_names() -> list[str]:
    return sorted(SHIPPED)


def _shipped_text() -> str:
    return ", ".join(shipped_names()) or "none yet"


def resolve_checkpoint(spec: str | Path) -> Path:
    """A checkpoint file from a shipped name, a file path, or a ``kvsieve train`` output folder."""
    if isinstance(spec, str) and canonical_name(spec) in SHIPPED:
        return CHECKPOINT_DIR / SHIPPED[canonical_name(spec)]
    path = Path(spec)
    if path.is_dir() and (path / "policy.safetensors").is_file():
        return path / "policy.safetensors"
    if path.is_file():
        return path
    raise ValueError(f"learned policy checkpoint {str(spec)!r} is neither a file nor a shipped name "
                     f"(shipped: {_shipped_text()}); {_HOW_TO_TRAIN}")


@dataclass(frozen=True)
class ModelShape:
    """What a checkpoint is tied to: the model's name, its cache geometry and its config's fingerprint
    (``None`` in checkpoints written before fingerprints); ``config`` holds the fingerprinted fields."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    fingerprint: str | None = None
    config: dict | None = None

    @classmethod
    def of(cls, model, name: str) -> ModelShape:
        config = text_config(model.config)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        fields = config_fields(config)
        return cls(name, int(config.num_hidden_layers), int(kv_heads), int(head_dim), fields_fingerprint(fields),
                   fields)

    def describe(self) -> str:
        return f"{self.num_layers} layers, {self.num_kv_heads} KV heads, head dim {self.head_dim}"

    def mismatch(self, other: ModelShape) -> str:
        """Why ``other`` (a live model) is not this checkpoint's model; ``""`` when it is (as far as both know)."""
        geometry = (other.num_layers, other.num_kv_heads, other.head_dim)
        if geometry != (self.num_layers, self.num_kv_heads, self.head_dim):
            return (f"the model it is applied to has {geometry[0]} layers, {geometry[1]} KV heads, head dim "
                    f"{geometry[2]}")
        if self.fingerprint is None or other.fingerprint is None or self.fingerprint == other.fingerprint:
            return ""
        mine, theirs = self.config or {}, other.config or {}
        diffs = [f"{k} {theirs.get(k)!r}, not {mine.get(k)!r}" for k in sorted(set(mine) | set(theirs))
                 if mine.get(k) != theirs.get(k)]
        return (f"the model it is applied to has the same geometry but another config (fingerprint "
                f"{other.fingerprint}, not {self.fingerprint}" + (f": {'; '.join(diffs)}" if diffs else "") + ")")

    def to_dict(self) -> dict:
        return asdict(self)

    def refuse_other(self, model, name: str | None, what: str, fix: str) -> None:
        """Refuse a live ``model`` (loaded under ``name``, when known) that is not this one: another name
        (aliases resolve), geometry or config fingerprint. ``what`` names the checkpoint, ``fix`` the remedy."""
        self.refuse_name(name, what, fix)
        problem = self.mismatch(ModelShape.of(model, name or ""))
        if problem:
            raise ValueError(f"{what} was trained for model {self.name!r} ({self.describe()}); {problem}: {fix}")

    def refuse_name(self, name: str | None, what: str, fix: str) -> None:
        """Refuse a model name (aliases resolve) that is not this one's; ``None`` (not known) passes."""
        if name is not None and canonical_name(name) != canonical_name(self.name):
            raise ValueError(f"{what} was trained for model {self.name!r}, not {name!r}; {fix}")

    def refuse_geometry(self, signals: Signals, what: str, fix: str) -> None:
        """Refuse a layer's cache whose geometry is not this model's."""
        have = (signals.num_layers, signals.num_kv_heads, signals.keys.shape[-1])
        if have != (self.num_layers, self.num_kv_heads, self.head_dim):
            raise ValueError(f"{what} was trained for model {self.name!r} ({self.describe()}); the model it is "
                             f"applied to has {have[0]} layers, {have[1]} KV heads, head dim {have[2]}: {fix}")


class LearnedPolicy(Policy):
    """Keep scores from a trained :class:`~kvsieve.learn.network.KeepNet`; window kept by the selection."""

    name = "learned"

    def __init__(self, checkpoint: str | None = None, model: str | None = None, window: int | None = None,
                 allocation: str = "uniform", **kwargs) -> None:
        if allocation not in ALLOCATIONS:
            raise ValueError(f"allocation {allocation!r} is not one of {list(ALLOCATIONS)}")
        self.allocation = allocation
        if checkpoint is None:
            raise ValueError(f"the learned policy needs checkpoint=PATH or a shipped name (shipped: "
                             f"{_shipped_text()}); {_HOW_TO_TRAIN}")
        path = resolve_checkpoint(checkpoint)
        loaded = load_checkpoint(path)
        net = KeepNet(NetConfig(**loaded.meta["net"]))
        try:
            net.load_state_dict(loaded.group("net"), strict=True)
        except RuntimeError as err:
            raise ValueError(f"checkpoint {str(path)!r} does not hold the network its metadata describes: "
                             f"{err}") from err
        self.checkpoint = str(path)
        self._setup(net, ModelShape(**loaded.meta["model"]), window or int(loaded.meta["window"]), **kwargs)
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
        return (resolve_checkpoint(checkpoint),) if checkpoint is not None else ()

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
