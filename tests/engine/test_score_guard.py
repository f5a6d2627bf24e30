"""The engine refuses NaN and -inf scores from every policy (issue 52): selection reads both as "never keep", so a
policy scoring NaN everywhere would keep only its protected sinks and window and still look like a working policy
(an evolved program doing so once scored 100 in eval; a learned or kvzap checkpoint could be served that way).
+inf stays allowed ("keep first", what ExpectedAttention and KVzip give the entries they protect)."""

import pytest
import torch
from conftest import TOKENIZER

import kvsieve
from kvsieve.engine.compress import checked_scores
from kvsieve.engine.reconstruct import ReconstructionPrompt
from kvsieve.policies import get, names
from kvsieve.policy import Policy
from kvsieve.selection import Selection
from kvsieve.signals import Signals

FAMILIES = [n for n in names(kinds=("policy",)) if n != "full"]
HEADER = ReconstructionPrompt.from_tokenizer(TOKENIZER).header


def poisoned(policy: Policy, value: float, layer: int = 1, entry: int = 10) -> Policy:
    """``policy`` whose scores of ``layer`` hold ``value`` at one entry of head 0 (this instance only)."""
    score = policy.score

    def bad(signals):
        scores = score(signals).clone()
        if signals.layer_idx == layer:
            scores[0, 0, entry] = value
        return scores

    policy.score = bad
    return policy


def build(name: str) -> Policy:
    return get(name, tokenizer=TOKENIZER) if name == "kvzip" else get(name, window=8)


@pytest.mark.parametrize("value", [float("nan"), float("-inf")])
@pytest.mark.parametrize("name", FAMILIES)
@torch.no_grad()
def test_every_family_scoring_nan_or_minus_inf_is_refused_naming_policy_and_layer(llama, prompt_ids, name, value):
    ids = torch.cat([torch.tensor([HEADER]), prompt_ids], 1)  # KVzip keeps the template header: give it one
    policy = poisoned(build(name), value)
    what = "1 entries NaN and 0 -inf" if value != value else "0 entries NaN and 1 -inf"
    with pytest.raises(ValueError, match=rf"policy '{policy.name}' scored {what} in layer 1"):
        with kvsieve.attach(llama, policy, ratio=0.5):
            llama(input_ids=ids, use_cache=True)


@pytest.mark.parametrize("mode", [dict(), dict(mode="decode", chunk_size=16)])
@torch.no_grad()
def test_prefill_and_decode_time_eviction_both_refuse_nan(llama, prompt_ids, mode):
    policy = poisoned(get("snapkv", window=8), float("nan"), layer=0)
    with pytest.raises(ValueError, match=r"policy 'snapkv' scored 1 entries NaN and 0 -inf in layer 0"):
        with kvsieve.attach(llama, policy, ratio=0.5, **mode):
            llama(input_ids=prompt_ids, use_cache=True)


class Positions(Policy):
    """Older entries first, with +inf on entries 40..43 of every head: they must be kept although they are young."""

    name = "positions_plus_inf"

    def score(self, signals):
        scores = -signals.positions.float()
        scores[..., 40:44] = float("inf")
        return scores


@torch.no_grad()
def test_plus_inf_is_allowed_and_means_keep_first(llama, prompt_ids):
    with kvsieve.attach(llama, Positions(Selection(sink=0, recent=0), window=1), kept=20):
        cache = llama(input_ids=prompt_ids, use_cache=True).cache
    for layer in cache.layers:
        kept = set(layer.positions[0, 0].tolist())
        # 20 kept of 96, nothing protected: the four +inf entries, then the 16 oldest
        assert kept == set(range(16)) | {40, 41, 42, 43}, sorted(kept)


def test_padding_may_hold_minus_inf_but_a_keepable_entry_may_not():
    class Fixed(Policy):
        name = "fixed"

        def __init__(self, scores):
            super().__init__(window=1)
            self.scores = scores

        def score(self, signals):
            return self.scores

    n = 6
    signals = Signals(keys=torch.zeros(1, 2, n, 4), values=torch.zeros(1, 2, n, 4),
                      window_queries=torch.zeros(1, 4, 1, 4), positions=torch.arange(n).expand(1, 2, n),
                      layer_idx=3, num_layers=4, scaling=0.5)
    valid = torch.ones(1, 2, n, dtype=torch.bool)
    valid[0, 1, 4:] = False  # head 1 is two entries shorter: padding the engine masks itself
    scores = torch.randn(1, 2, n)
    scores[0, 1, 4:] = float("-inf")
    assert torch.equal(checked_scores(Fixed(scores), signals, valid), scores)
    with pytest.raises(ValueError, match=r"policy 'fixed' scored 0 entries NaN and 2 -inf in layer 3"):
        checked_scores(Fixed(scores), signals)  # without the mask those entries could be kept
    scores[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"scored 1 entries NaN and 0 -inf in layer 3"):
        checked_scores(Fixed(scores), signals, valid)
    integer = torch.ones(1, 2, n, dtype=torch.long)
    assert checked_scores(Fixed(integer), signals).dtype == torch.float32
