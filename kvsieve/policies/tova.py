"""TOVA: Oren et al., "Transformers are Multi-State RNNs", EMNLP 2024, arXiv:2401.06104.

Signal: the attention of the last query only (softmax over its full row, itself included), averaged
over **all** query heads of the layer, so every KV head keeps the same tokens: the paper's Token
Omission Via Attention drops the tokens with the lowest head-averaged attention from the current
query (the authors' ``TOVACache.reduce``: ``mean(attn_weights[:, :, -1, :], dim=1)``, then top-k).

Nothing is protected: the current (last) token competes like the others, as in the paper and the
authors' code. NVIDIA kvpress's ``TOVAPress`` force-keeps it ("a very slight difference from TOVA");
its own attention is usually among the highest, so the two rarely differ. For that variant pass
``selection=Selection(recent=1)``.
"""

import torch

from kvsieve.policy import Policy
from kvsieve.signals import Signals


class TOVA(Policy):
    name = "tova"
    uses_window = False  # reads the last query only and protects nothing

    def score(self, signals: Signals) -> torch.Tensor:
        last = signals.window_attention[:, :, -1, :].mean(dim=1, keepdim=True)
        return last.expand(-1, signals.num_kv_heads, -1)
