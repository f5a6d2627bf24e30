"""Learned-policy checkpoints: one safetensors file (never pickle), metadata as one JSON string.

Tensors: ``net.*`` the network's weights; a training checkpoint adds ``optim.*`` (Adam's moments and
step counts) and ``baseline.*`` (the running-mean baseline), so ``kvsieve train`` resumes to the same
result. The metadata (key ``kvsieve_learned``) holds the format version, the feature list, the network
shape, the model the policy was trained for (name, layers, KV heads, head dim, and the fingerprint of
its config with the fingerprinted fields: :mod:`kvsieve.networks.fingerprint`), the observation
window, the training config and step, and a sha256 over every tensor's bytes: a file whose header
still parses but whose data was damaged is refused, not silently loaded.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvsieve.files import save_safetensors
from kvsieve.networks.keep_features import FEATURES
from kvsieve.networks.shipped import HOW_TO_TRAIN

__all__ = ["FORMAT", "METADATA_KEY", "Checkpoint", "save_checkpoint", "load_checkpoint", "read_checkpoint_file",
           "tensor_digest", "load_once"]

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


def tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
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
    meta = dict(meta, format=FORMAT, features=list(FEATURES), sha256=tensor_digest(tensors))
    # an interrupted write never leaves a half-written checkpoint behind
    return save_safetensors(tensors, path, metadata={METADATA_KEY: json.dumps(meta, sort_keys=True)})


def read_checkpoint_file(path: str | Path, key: str, version: int, what: str, how_to_train: str
                         ) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metadata under ``key``, tensors) of a kvsieve checkpoint file, checked: readable, ``key`` present, format
    ``version``, tensors matching their checksum. Every failure is a ValueError naming the file; ``what`` names
    the family (``learned``, ``kvzap``), ``how_to_train`` the remedy."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} checkpoint {str(path)!r} does not exist; {how_to_train}")
    try:
        with safe_open(str(path), framework="pt") as handle:
            header = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except (SafetensorError, OSError, RuntimeError, ValueError) as err:
        raise ValueError(f"{what} checkpoint {str(path)!r} is not a readable safetensors file (truncated or "
                         f"corrupt?): {err}") from err
    if key not in header:
        raise ValueError(f"{str(path)!r} is a safetensors file but not a kvsieve {what} checkpoint (no {key!r} "
                         f"metadata); {how_to_train}")
    try:
        meta = json.loads(header[key])
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} checkpoint {str(path)!r} has corrupt metadata: {err}") from err
    if not isinstance(meta, dict) or meta.get("format") != version:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise ValueError(f"{what} checkpoint {str(path)!r} has format {found!r}; this kvsieve reads format {version}")
    if meta.get("sha256") != tensor_digest(tensors):
        raise ValueError(f"{what} checkpoint {str(path)!r} is corrupt: its tensors do not match the checksum it was "
                         "saved with")
    return meta, tensors


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read and check a learned-policy checkpoint; every failure is a ValueError that names the file and the
    problem."""
    meta, tensors = read_checkpoint_file(path, METADATA_KEY, FORMAT, "learned-policy", HOW_TO_TRAIN["learned"])
    if list(meta.get("features", [])) != list(FEATURES):
        raise ValueError(f"checkpoint {str(path)!r} was trained on features {meta.get('features')}; this kvsieve "
                         f"computes {list(FEATURES)}: retrain it")
    for key in ("model", "net", "window"):
        if key not in meta:
            raise ValueError(f"checkpoint {str(path)!r} lacks the {key!r} entry in its metadata")
    return Checkpoint(meta, tensors)


_LOAD_LOCK = threading.Lock()


def load_once(cache: dict, path: Path, read: Callable[[Path], tuple[Any, dict]]) -> tuple[Any, dict]:
    """``read(path)`` once per file version: (network, metadata) from ``cache``, keyed by (resolved path, mtime_ns,
    size), so a grid that builds a policy per cell reads its checkpoint once and a rewritten file is read again.
    The network is shared (its policies never change it); the metadata is a copy for the caller."""
    try:
        stat = path.stat()
    except OSError:
        return read(path)  # names the problem
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    with _LOAD_LOCK:
        hit = cache.get(key)
    if hit is None:
        hit = read(path)
        with _LOAD_LOCK:
            for older in [k for k in cache if k[0] == key[0]]:  # the file's earlier contents
                del cache[older]
            cache[key] = hit
    net, meta = hit
    return net, copy.deepcopy(meta)
