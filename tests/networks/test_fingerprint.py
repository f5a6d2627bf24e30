"""A model's fingerprint: the config fields that make it that model, normalised so a converted config matches."""

from __future__ import annotations

import hashlib
import json

import numpy as np
from transformers import LlamaConfig

from kvsieve.networks.fingerprint import FIELDS, config_fields, config_fingerprint


def llama(**changes) -> LlamaConfig:
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
    return LlamaConfig(**{**base, **changes})


def test_fields_are_read_and_derived_from_the_config():
    fields = config_fields(llama())
    assert list(fields) == list(FIELDS)
    assert fields["head_dim"] == 64 // 4  # derived where the config has none
    assert fields["num_key_value_heads"] == 2 and fields["model_type"] == "llama"
    assert fields["rope_theta"] == 10000.0 and fields["rope_type"] == "default"


def test_the_fingerprint_is_the_sha256_of_the_sorted_fields():
    fields = config_fields(llama())
    expected = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    assert config_fingerprint(llama()) == expected


def test_a_float32_round_trip_of_the_norm_epsilon_keeps_the_fingerprint():
    eps32 = float(np.float32(1e-5))  # what a GGUF-converted config stores
    assert eps32 != 1e-5
    assert config_fingerprint(llama(rms_norm_eps=eps32)) == config_fingerprint(llama())


def test_a_field_that_makes_another_model_changes_the_fingerprint():
    same_geometry = [llama(vocab_size=256), llama(intermediate_size=96), llama(rope_theta=500000.0)]
    assert len({config_fingerprint(c) for c in [llama(), *same_geometry]}) == 4
