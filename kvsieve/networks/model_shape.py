"""What a trained network is tied to: a model's name, its cache geometry and its config's fingerprint.

Learned-policy and kvzap checkpoints record a :class:`ModelShape`; a policy built from one refuses a model that
is not it (another name, aliases resolved; another geometry; another config fingerprint,
:mod:`kvsieve.networks.fingerprint`), since what a network learned means nothing on another model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvsieve.bundled import canonical_name
from kvsieve.networks.fingerprint import config_fields, fields_fingerprint, text_config
from kvsieve.signals import Signals

__all__ = ["ModelShape"]


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
