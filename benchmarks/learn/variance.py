"""How noisy is one step's policy gradient? The baselines compared on the same rollouts at the warm start.

An ablation that needs no training run: for a few training requests, ``repeats`` independent sets of rollouts (K per
budget, every budget, fresh Gumbel noise) are drawn at the warm start, and each set gives one gradient estimate per
baseline (the same rollouts, so only the baseline differs): ``loo`` (the mean of the other K - 1), ``greedy`` (the
deterministic policy's return, one extra rollout per budget) and ``none`` (zero). Printed per baseline: the mean
cosine similarity between two estimates of the same request (1: every estimate points the same way; about 0: noise)
and the noise-to-signal ratio ``E||g - mean g||^2 / ||mean g||^2`` (lower is better), averaged over requests.

    python benchmarks/learn/variance.py --config configs/train-kvzap-smollm2.toml --requests 4 --repeats 6
"""

from __future__ import annotations

import argparse
import itertools

import torch

from kvsieve.learn.baselines import leave_one_out
from kvsieve.learn.reinforce import Trainer, reinforce_loss
from kvsieve.learn.rollout import context_cache_for, rollout, step_returns
from kvsieve.learn.train_config import load_config, load_episodes, seeded_generator
from kvsieve.models import load
from kvsieve.networks.model_shape import ModelShape
from kvsieve.selection import Budget

__all__ = ["BASELINE_NAMES", "gradient_estimates", "noise_summary"]

BASELINE_NAMES = ("loo", "greedy", "none")


def _flat_grad(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1).clone() for p in trainer.net.parameters()
                      if p.requires_grad and p.grad is not None])


def gradient_estimates(trainer: Trainer, index: int, repeats: int, tag: str = "variance") -> dict[str, list]:
    """Per baseline, ``repeats`` flattened gradient estimates on training request ``index`` at every ratio."""
    c, episode = trainer.config, trainer.episodes[index]
    cache = context_cache_for(trainer.model, episode, c.window)
    teacher = trainer.teacher(index, cache)
    shared: dict = {}
    greedy = {}
    for ratio in c.ratios:
        kept = Budget(ratio=ratio).resolve(episode.context.shape[1])
        result = rollout(trainer.model, episode, trainer.rollout_policy(None, False, shared), "prefill", kept,
                         c.chunk_size, teacher, cache)
        greedy[ratio] = step_returns(result)
    out: dict[str, list] = {name: [] for name in BASELINE_NAMES}
    for repeat in range(repeats):
        groups = []
        for ratio in c.ratios:
            kept = Budget(ratio=ratio).resolve(episode.context.shape[1])
            samples = [rollout(trainer.model, episode,
                               trainer.rollout_policy(seeded_generator(c.seed, tag, index, repeat, ratio, r), True,
                                                      shared), "prefill", kept, c.chunk_size, teacher, cache)
                       for r in range(c.rollouts)]
            groups.append((ratio, samples))
        for name in BASELINE_NAMES:
            trainer._step_logits = {}
            trainer.net.zero_grad(set_to_none=True)
            losses = []
            for ratio, samples in groups:
                returns = [step_returns(s) for s in samples]
                bases = (leave_one_out(returns) if name == "loo" else
                         [dict(greedy[ratio]) for _ in samples] if name == "greedy" else
                         [{t: 0.0 for t in r} for r in returns])
                losses.append(torch.stack([reinforce_loss(trainer.net, s.decisions, r, b, 0.0, trainer.logits_of)[0]
                                           for s, r, b in zip(samples, returns, bases)]).mean())
            torch.stack(losses).mean().backward()
            out[name].append(_flat_grad(trainer))
    trainer._step_logits = {}
    return out


def noise_summary(estimates: list[torch.Tensor]) -> tuple[float, float]:
    """(mean pairwise cosine similarity, E||g - mean||^2 / ||mean||^2) of one request's gradient estimates."""
    g = torch.stack([e.double() for e in estimates])
    mean = g.mean(dim=0)
    cosines = [float(torch.nn.functional.cosine_similarity(a, b, dim=0)) for a, b in itertools.combinations(g, 2)]
    noise = float(((g - mean) ** 2).sum(dim=1).mean() / (mean ** 2).sum().clamp_min(1e-300))
    return sum(cosines) / len(cosines), noise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a training config (configs/train-*.toml)")
    parser.add_argument("--requests", type=int, default=4, help="training requests measured (the first ones)")
    parser.add_argument("--repeats", type=int, default=6, help="independent rollout sets per request")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    config = load_config(args.config)
    model, tokenizer = load(config.model, dtype=config.dtype)
    episodes = load_episodes(config, tokenizer)[: args.requests]
    trainer = Trainer(config, model, ModelShape.of(model, config.model), episodes)
    rows = {name: [] for name in BASELINE_NAMES}
    for index in range(len(episodes)):
        for name, estimates in gradient_estimates(trainer, index, args.repeats).items():
            rows[name].append(noise_summary(estimates))
        print(f"request {index + 1}/{len(episodes)} done", flush=True)
    print(f"\n{config.model}, {config.length} tokens, {len(episodes)} training requests x {args.repeats} rollout sets "
          f"(K = {config.rollouts} at each of {config.ratios}), trainable {config.trainable!r}, at the warm start\n")
    print("| baseline | mean cosine between two estimates | noise / signal |\n|---|---:|---:|")
    for name in BASELINE_NAMES:
        cos = sum(r[0] for r in rows[name]) / len(rows[name])
        nsr = sum(r[1] for r in rows[name]) / len(rows[name])
        print(f"| {name} | {cos:.3f} | {nsr:.2f} |")


if __name__ == "__main__":
    main()
