"""The signal fit's settings on the stopping rule's held-out requests: mean per-step KL of the fit alone, per setting.

A REINFORCE config with ``signal_fit = true`` fits the signals' map before step 0 (kvsieve/learn/signal_fit.py).
This collects the fit's rows once from the config's training requests, then for each setting (the continuation's
weight lambda in the target, with or without the per-head rescale of the surrogate) fits the map on them and scores
the fitted policy, greedy, on the config's held-out requests (``eval_samples`` per task from ``eval_seed``: the
stopping rule's, never a test's) at the config's ratios. Settings are chosen here, before a run is declared::

    python benchmarks/signal_fit_sweep.py --seed 5000 \\
        --config experiments/2026-12-06-signal-fit-qwen/train-kvzap-qwen-signal-fit.toml \\
        --settings 1,4,16,64,1a,4a,8a,16a,32a,64a --out results/learned/issue51/signal-fit-sweep-qwen-s5000.csv

(``16a``: lambda 16 with the rescale.) Rows: ``continuation_weight, affine, ratio, episode, kl``; the table printed
gives the mean over requests per ratio and over all.
"""

from __future__ import annotations

import argparse
import copy
import csv
from pathlib import Path

import torch

from kvsieve.learn.heldout import HeldOut
from kvsieve.learn.reinforce import Trainer
from kvsieve.learn.signal_fit import collect_rows, fit_rows
from kvsieve.learn.train_config import load_config, load_episodes, load_heldout
from kvsieve.models import load
from kvsieve.networks.model_shape import ModelShape


def parse_settings(text: str) -> list[tuple[float, bool]]:
    """``"1,16a"`` -> [(1.0, False), (16.0, True)]: lambda, then ``a`` for the rescale."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        affine = item.endswith("a")
        try:
            weight = float(item[:-1] if affine else item)
        except ValueError:
            raise SystemExit(f"setting {item!r} is not a number with an optional 'a' (e.g. 16 or 16a)") from None
        if not weight > 0:
            raise SystemExit(f"setting {item!r}: the continuation's weight must be > 0")
        out.append((weight, affine))
    if not out:
        raise SystemExit("--settings names no setting")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="a REINFORCE training config with signal_fit = true")
    parser.add_argument("--seed", type=int, default=None, help="the training seed (default: the config's)")
    parser.add_argument("--settings", required=True, help="comma-separated lambdas, 'a' suffix: with the rescale")
    parser.add_argument("--out", required=True, help="CSV of the per-request rows")
    args = parser.parse_args()
    settings = parse_settings(args.settings)
    config = load_config(args.config, seed=args.seed)
    if not config.signal_fit:
        raise SystemExit(f"{args.config} does not fit the signals' map (signal_fit = false)")
    torch.set_num_threads(1)
    model, tokenizer = load(config.model, dtype=config.dtype)
    trainer = Trainer(config, model, ModelShape.of(model, config.model), load_episodes(config, tokenizer))
    start = copy.deepcopy(trainer.net.state_dict())
    rows = collect_rows(trainer.net, trainer.kvzap_meta, model, trainer.episodes, progress=True)
    heldout = HeldOut(model, load_heldout(config, tokenizer), config.ratios, config.window, config.teacher_top_k)
    out_rows = []
    print(f"| lambda | rescale | {' | '.join(f'{1 - r:.1%} kept' for r in config.ratios)} | mean |")
    print("|---:|---|" + "---:|" * (len(config.ratios) + 1))
    for weight, affine in settings:
        trainer.net.load_state_dict(start)
        fit_rows(trainer.net, rows, config.signal_ridge, weight, affine)
        found = heldout.evaluate(lambda shared: trainer.rollout_policy(None, False, shared), 0)
        out_rows += [{"continuation_weight": weight, "affine": affine, "ratio": r["ratio"], "episode": r["episode"],
                      "kl": r["kl"]} for r in found]
        means = [sum(r["kl"] for r in found if r["ratio"] == ratio) / len(heldout.episodes)
                 for ratio in config.ratios]
        overall = sum(r["kl"] for r in found) / len(found)
        print(f"| {weight:g} | {'yes' if affine else 'no'} | {' | '.join(f'{m:.4f}' for m in means)} | "
              f"{overall:.4f} |", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["continuation_weight", "affine", "ratio", "episode", "kl"])
        writer.writeheader()
        writer.writerows(out_rows)


if __name__ == "__main__":
    main()
