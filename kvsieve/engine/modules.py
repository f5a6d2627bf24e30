"""Which modules of a HuggingFace decoder the engine hooks.

Every supported architecture (Llama, Qwen2, Mistral, ...) names its attention module's projections
``q_proj`` / ``k_proj`` and gives it the ``layer_idx`` the cache is indexed by; nothing else in the
model has all three.
"""

from __future__ import annotations

import torch

__all__ = ["attention_modules"]


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's attention modules, in layer order."""
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj") and hasattr(m, "k_proj")]
