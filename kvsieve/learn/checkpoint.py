"""Learned-policy checkpoints: one safetensors file (never pickle), metadata as one JSON string.

Tensors: ``net.*`` the network's weights; a training checkpoint adds ``optim.*`` (Adam's moments and
step counts) and ``baseline.*`` (the running-mean baseline), so ``kvsieve train`` resumes to the same
result. The metadata (key ``kvsieve_learned``) holds the format version, the feature list, the network
shape, the model the policy was trained for (name, layers, KV heads, head dim, and the fingerprint of
its config with the fingerprinted fields: :mod:`kvsieve.learn.fingerprint`), the observation
window, the training config and step, and a sha256 over every tensor's bytes: a file whose header
still parses but whose data was damaged is refused, not silently loaded.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kvsieve.files import save_safetensors
from kvsieve.learn.features import FEATURES

__all__ = ["FORMAT", "METADATA_KEY", "Checkpoint", "save_checkpoint", "load_checkpoint"]

FORMAT = 1
METADATA_KEY = "kvsieve_learned"


@dataclass
class Checkpoint:
    meta: dict
    tensors: dict[str, torch.Tensor]

    def group(self, prefix: str) -> dict[str, torch.Tensor]:
        """Tensors under ``prefix.``, with the prefix removed."""
        start = len(prefix) + 1
        return {k[start:]: v for k, v in self.tensors.items() if k.startswith(prefix + ".")}


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    sha = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().contiguous().cpu()
        sha.update(name.encode())
        sha.update(str(tensor.dtype).encode() + str(tuple(tensor.shape)).encode())
        sha.update(tensor.view(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return sha.hexdigest()


def save_checkpoint(path: str | Path, meta: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """Write ``tensors`` and ``meta`` (plus format, features and checksum) atomically to ``path``."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    meta = dict(meta, format=FORMAT, features=list(FEATURES), sha256=_digest(tensors))
    # an interrupted write never leaves a half-written checkpoint behind
    return save_safetensors(tensors, path, metadata={METADATA_KEY: json.dumps(meta, sort_keys=True)})


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read and check a checkpoint; every failure is a ValueError that names the file and the problem."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"learned-policy checkpoint {str(path)!r} does not exist")
    try:
        with safe_open(str(path), framework="pt") as handle:
            header = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except (SafetensorError, OSError, RuntimeError, ValueError) as err:
        raise ValueError(f"checkpoint {str(path)!r} is not a readable safetensors file (truncated or corrupt?): "
                         f"{err}") from err
    if METADATA_KEY not in header:
        raise ValueError(f"checkpoint {str(path)!r} is a safetensors file but not a kvsieve learned-policy "
                         f"checkpoint (no {METADATA_KEY!r} metadata)")
    try:
        meta = json.loads(header[METADATA_KEY])
    except json.JSONDecodeError as err:
        raise ValueError(f"checkpoint {str(path)!r} has corrupt metadata: {err}") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise ValueError(f"checkpoint {str(path)!r} has format {found!r}; this kvsieve reads format {FORMAT}")
    if meta.get("sha256") != _digest(tensors):
        raise ValueError(f"checkpoint {str(path)!r} is corrupt: its tensors do not match the checksum it was "
                         "saved with")
    if list(meta.get("features", [])) != list(FEATURES):
        raise ValueError(f"checkpoint {str(path)!r} was trained on features {meta.get('features')}; this kvsieve "
                         f"computes {list(FEATURES)}: retrain it")
    for key in ("model", "net", "window"):
        if key not in meta:
            raise ValueError(f"checkpoint {str(path)!r} lacks the {key!r} entry in its metadata")
    return Checkpoint(meta, tensors)
