"""SnapKV: Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024,
arXiv:2404.14469.

Signal: attention from the last ``window`` queries (the observation window): each window query's
softmax over its full causal row (the prefix and the window entries it can see), summed over the
window queries, averaged over the query heads that share a KV head, then smoothed over the prefix
(the entries before the window) with a 1-D average pool of ``kernel_size`` (5), stride 1 and zero
padding that *counts* in the average (``count_include_pad=True``, PyTorch's default, which the
authors' code uses: ``F.avg_pool1d(attn_weights_sum, kernel_size, padding=kernel_size // 2,
stride=1)`` on ``attn_weights[..., :-window]``). The pool never reaches into the window: the last
prefix entries are averaged with zero padding, not with the window's scores. The window itself is
always kept; its scores are its summed attention, unpooled (they never decide anything).

GQA: the original code is written for one query head per KV head; averaging the group's scores
follows the authors' answer in SnapKV issue #22 (as NVIDIA kvpress does). Pooling, summing and
averaging are linear, so their order does not matter (``tests/policies/test_snapkv_derivation.py`` checks the
score against a from-scratch numpy derivation).

The window: kvsieve's default observation window is 64 queries for every policy; the paper's code
uses 32. Question-aware, the paper's premise is that the window *is* the question. A RULER question
with its template tail and answer prefix is about 40 tokens on SmolLM2, so 64 queries reach some 20-26
tokens back into the haystack; those queries attend to their neighbourhood and outweigh the few that
read the needle's digits, and the needle is kept truncated (``benchmarks/snapkv_question.py``: +qa at
50%, niah_single_1 1k, 3 samples: window 64 and 48 answer 0/3 and 1/3, windows 8-40 2/3 to 3/3; pooling
and the GQA group mean are not the cause). Pass ``snapkv(window=32)`` for question-aware runs; the default
stays 64 so stored ``snapkv`` rows keep their meaning.
"""

import torch
import torch.nn.functional as F

from kvsieve.policy import Policy
from kvsieve.selection import Selection
from kvsieve.signals import Signals


def snapkv_scores(signals: Signals, kernel_size: int = 5) -> torch.Tensor:
    """(b, h, n) window attention, pooled over the prefix; shared by PyramidKV, AdaKV and ChunkKV."""
    scores = signals.window_attention_kv.sum(dim=2)
    b, h, n = scores.shape
    prefix = n - signals.window_size
    if kernel_size > 1 and prefix > 0:
        pooled = F.avg_pool1d(scores[..., :prefix].reshape(b * h, 1, prefix), kernel_size, stride=1,
                              padding=kernel_size // 2, count_include_pad=True).view(b, h, prefix)
        scores = torch.cat([pooled, scores[..., prefix:]], dim=-1)
    return scores


class SnapKV(Policy):
    name = "snapkv"

    def __init__(self, kernel_size: int = 5, chunk_size: int = 1, **kwargs) -> None:
        if not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be a positive odd int, got {kernel_size!r}")
        self.kernel_size = kernel_size
        self.chunk_size = chunk_size  # > 1: whole chunks per head (the FRC decomposition's "structure" arm)
        super().__init__(**kwargs)

    def default_selection(self) -> Selection:
        return Selection(recent=self.window, chunk_size=self.chunk_size)

    def score(self, signals: Signals) -> torch.Tensor:
        return snapkv_scores(signals, self.kernel_size)
