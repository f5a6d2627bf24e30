"""Attach policies to HF models and prune their caches."""

from kvsieve.engine.attach import SUPPORTED_MODEL_TYPES, Session, attach
from kvsieve.engine.compress import CompressionReport, LayerReport, compress_cache

__all__ = ["SUPPORTED_MODEL_TYPES", "Session", "attach", "CompressionReport", "LayerReport", "compress_cache"]
