"""Held-out loss of several KVzip surrogates on the same positions: one training run's held-out sequences.

A run of ``train_kvzap`` reports its own checkpoint's held-out loss; a checkpoint from another run was held out
on other sequences, so the two reports do not compare. This reads one run's saved rows (``RUN/kvzap-data``,
reused, so nothing is recomputed once the run has collected them), takes that run's held-out split and scores
each checkpoint on it, with the constant predictor (the run's training means) as the floor::

    python benchmarks/kvzap_heldout.py --run runs/kvzap-qwen-big \\
        --checkpoints qwen2.5-coder-0.5b-instruct,runs/kvzap-qwen-big/policy.safetensors

A checkpoint whose own training saw some of these sequences scores too well on them: the run's held-out
sequences are its last ones, so compare against checkpoints trained on fewer, earlier sequences with care.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvsieve.learn.kvzap_train import KVzapTrainConfig, collect_rows, heldout_count, split_rows
from kvsieve.models import load
from kvsieve.networks.kvzap_net import load_kvzap
from kvsieve.networks.shipped import resolve_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", required=True, help="a train_kvzap output folder (report.json, kvzap-data/)")
    parser.add_argument("--checkpoints", required=True, help="comma-separated shipped names or .safetensors paths")
    args = parser.parse_args()
    report_path = Path(args.run) / "report.json"
    if not report_path.is_file():
        raise SystemExit(f"{report_path} does not exist: --run must be a finished train_kvzap output folder")
    config = KVzapTrainConfig(**json.loads(report_path.read_text())["config"])
    torch.set_num_threads(1)
    model, tokenizer = load(config.model, dtype=config.dtype)
    data, _ = collect_rows(config, model, tokenizer, progress=False)
    _, y, x_held, y_held = split_rows(data, config.holdout)
    print(f"run {args.run}: {len(data)} sequences, {heldout_count(len(data), config.holdout)} held out "
          f"({x_held.shape[1]} positions per layer), model {config.model}")
    print("| checkpoint | variant | held-out MSE of log KVzip score |")
    print("|---|---|---:|")
    print(f"| constant (the run's training means) | | {float(((y.mean(1, keepdim=True) - y_held) ** 2).mean()):.3f} |")
    for spec in filter(None, (s.strip() for s in args.checkpoints.split(","))):
        net, meta = load_kvzap(resolve_checkpoint("kvzap", spec))
        if meta.get("inputs", "kv") != config.inputs:
            raise SystemExit(f"{spec} reads {meta.get('inputs')!r} inputs and the run's rows hold {config.inputs!r}")
        with torch.no_grad():
            for variant in ("linear", "mlp"):
                loss = float(((net.forward_all(x_held, variant) - y_held) ** 2).mean())
                default = " (its default)" if variant == meta["variant"] else ""
                print(f"| {spec} | {variant}{default} | {loss:.3f} |")


if __name__ == "__main__":
    main()
