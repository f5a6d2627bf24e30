"""A model's identity for a learned checkpoint: the fields of its config that make it that model.

A checkpoint's network reads features (layer embedding, norms relative to their layer, ...) whose meaning
depends on the model, and two models can share a cache geometry (a randomly initialised 30-layer Llama
with 3 KV heads of dim 64 looks like SmolLM2-135M to the cache). So a checkpoint records, beside the
geometry, :data:`FIELDS` of the model's text config and a sha256 over them (:func:`config_fingerprint`).
Floats are rounded to 6 significant digits (a GGUF-converted config stores ``rms_norm_eps`` as float32);
the rotary base is read from ``rope_theta`` or from transformers 5's ``rope_parameters``. Dtype, attention
implementation and transformers version are not part of it: they do not change which model it is.
"""

from __future__ import annotations

import hashlib
import json

__all__ = ["FIELDS", "config_fields", "config_fingerprint", "fields_fingerprint", "text_config"]

FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_theta", "rope_type", "rms_norm_eps",
          "tie_word_embeddings", "hidden_act")


def text_config(config):
    """The decoder's config of a (possibly multimodal) HF config."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _plain(value):
    if isinstance(value, float):
        return float(f"{value:.6g}")
    return value


def config_fields(config) -> dict:
    """:data:`FIELDS` of a HF config (``None`` where it has none), normalised as the module docstring says."""
    config = text_config(config)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    heads = getattr(config, "num_attention_heads", None)
    out = {name: getattr(config, name, None) for name in FIELDS}
    out["head_dim"] = out["head_dim"] or (config.hidden_size // heads if heads else None)
    out["num_key_value_heads"] = out["num_key_value_heads"] or heads
    out["rope_theta"] = out["rope_theta"] or (rope.get("rope_theta") if isinstance(rope, dict) else None)
    out["rope_type"] = (rope.get("rope_type") or rope.get("type")) if isinstance(rope, dict) and rope else "default"
    return {name: _plain(out[name]) for name in FIELDS}


def fields_fingerprint(fields: dict) -> str:
    """sha256 (first 16 hex digits) of the fields as sorted JSON."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def config_fingerprint(config) -> str:
    return fields_fingerprint(config_fields(config))
