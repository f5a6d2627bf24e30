"""A kvsieve cache on disk: :func:`save_cache` writes a dense cache, :func:`load_cache` reads it back bit for bit.

Prefilling is the expensive part of evaluating many policies on the same contexts (a minute a 2k-token sample
for Qwen2.5-0.5B on one CPU core): the evolution's dev set saves its full-cache prefills so that a resumed run
reads them instead of prefilling again. What a :class:`~kvsieve.engine.cache.SieveLayer` holds is stored as
safetensors (nothing runs while loading): keys, values, positions, padding mask, accumulated attention and
remembered scores when present, the window's queries, the rotary parameters and the hidden states when captured,
and the scalars (tokens seen, window, attention scaling). A ragged layer, query statistics and layers kvsieve does
not own (a sliding-window layer) are refused rather than half-saved. The file is written to a temporary name and
renamed, so an interrupted write leaves nothing a later load would read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers.cache_utils import DynamicCache

from kvsieve.engine.cache import SieveLayer, install
from kvsieve.files import save_safetensors

__all__ = ["save_cache", "load_cache", "FORMAT_VERSION"]

FORMAT_VERSION = 1
_TENSORS = ("_keys", "_values", "_positions", "_valid", "_attention", "_scores")  # the dense fields, as stored
_EXTRAS = ("recent_queries", "hidden_states")


def save_cache(path: str | Path, cache: DynamicCache, metadata: dict[str, str] | None = None) -> None:
    """Write ``cache`` (every layer a dense :class:`SieveLayer`) and string ``metadata`` to ``path``."""
    tensors: dict[str, torch.Tensor] = {}
    layers = []
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, SieveLayer):
            raise ValueError(f"layer {i} is a {type(layer).__name__}, not a kvsieve layer: only caches made under "
                             "kvsieve.attach() whose every layer is kvsieve's can be saved")
        if layer.store is not None:
            raise ValueError(f"layer {i} keeps its entries in per-head segments (pruned or decoding): save the cache "
                             "right after the prompt's forward")
        if layer.query_stats is not None:
            raise ValueError(f"layer {i} holds query statistics, which save_cache does not store")
        if layer.physical_length == 0:
            raise ValueError(f"layer {i} is empty: save a cache that has read tokens")
        stored = []
        for name in _TENSORS + _EXTRAS:
            value = layer.__dict__.get(name)
            if value is not None:
                tensors[f"{i}.{name}"] = value.detach().contiguous()
                stored.append(name)
        if layer.rope is not None:
            tensors[f"{i}.rope_inv_freq"] = layer.rope[0].detach().contiguous()
        layers.append({"seen": layer.seen, "window": layer.window, "track_attention": layer.track_attention,
                       "scaling": getattr(layer, "scaling", None), "stored": stored,
                       "rope_attention_scaling": None if layer.rope is None else float(layer.rope[1])})
    header = {"format": str(FORMAT_VERSION), "layers": json.dumps(layers), **(metadata or {})}
    save_safetensors(tensors, path, metadata=header)


def load_cache(path: str | Path, config) -> tuple[DynamicCache, dict[str, str]]:
    """The cache :func:`save_cache` wrote to ``path``, for a model of HF ``config``, and the metadata saved with it."""
    with safe_open(str(path), framework="pt") as handle:
        header = handle.metadata() or {}
        if header.get("format") != str(FORMAT_VERSION):
            raise ValueError(f"{path} is not a kvsieve cache file of format {FORMAT_VERSION} "
                             f"(format {header.get('format')!r})")
        layers = json.loads(header["layers"])
        cache = DynamicCache(config=config)
        if len(cache.layers) != len(layers):
            raise ValueError(f"{path} holds {len(layers)} layers; a cache of this model has {len(cache.layers)}")
        install(cache, window=layers[0]["window"], track_attention=layers[0]["track_attention"])
        for i, (layer, saved) in enumerate(zip(cache.layers, layers)):
            if not isinstance(layer, SieveLayer):
                raise ValueError(f"{path}: layer {i} of this model is a {type(layer).__name__}, saved as kvsieve's")
            stored = {name: handle.get_tensor(f"{i}.{name}") for name in saved["stored"]}
            layer.update(stored["_keys"], stored["_values"])  # initialises the layer as a prefill would
            for name in _TENSORS:
                layer.__dict__[name] = stored.get(name)
            for name in _EXTRAS:
                setattr(layer, name, stored.get(name))
            layer.seen, layer.window, layer.track_attention = saved["seen"], saved["window"], saved["track_attention"]
            if saved["scaling"] is not None:
                layer.scaling = saved["scaling"]
            if saved["rope_attention_scaling"] is not None:
                layer.rope = (handle.get_tensor(f"{i}.rope_inv_freq"), saved["rope_attention_scaling"])
    metadata = {k: v for k, v in header.items() if k not in ("format", "layers")}
    return cache, metadata
