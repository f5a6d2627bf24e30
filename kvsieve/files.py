"""Files written whole: a reader sees the old file or the new one, never half of one.

Each write goes to a temporary file beside the target, unique to the writer, and is renamed onto the target
when complete. Two processes writing the same file at once (two evolution runs sharing a dev-cache folder) each
write their own temporary file and the last rename wins; an interrupted or failed write leaves the target as it
was and removes its temporary file.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

__all__ = ["written_whole", "save_safetensors"]


@contextmanager
def written_whole(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` (its folder created) for the block to write; renamed onto ``path`` when
    the block ends, removed if it raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # named, not created: the block's own open() gives the file the permissions any other file it writes gets
    name = str(path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.partial")
    try:
        yield Path(name)
        os.replace(name, path)
    finally:
        if os.path.exists(name):
            os.unlink(name)


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path,
                     metadata: dict[str, str] | None = None) -> Path:
    """``safetensors.torch.save_file`` written whole (:func:`written_whole`); returns ``path``."""
    with written_whole(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return Path(path)
