"""The supervised ablation: the same keep network regressed on KVzip's reconstruction scores.

KVzap-style imitation: instead of learning from the KL reward, the network learns to predict a
teacher's per-entry importance. The teacher is KVzip (Kim et al., "KVzip: Query-Agnostic KV Cache
Compression with Context Reconstruction", arXiv:2505.23416), whose scores the engine computes
(:func:`kvsieve.engine.reconstruct.reconstruction_scores`): the largest attention an entry receives
while the model repeats its context. Only the ranking of scores inside a head matters to a top-k
selection, so the target of an entry is its ``log`` score standardised over the head's free entries
(neither the chat-template header, which KVzip always keeps, nor the observation window, which every
learned policy keeps), and the loss is the mean squared error on those entries.

One run (``kvsieve train --objective imitate``, same :class:`~kvsieve.learn.train_config.TrainConfig`):

1. for every training episode, prefill the context with the full cache, run the reconstruction and
   record each layer's features (:func:`kvsieve.networks.keep_features.extract`) and targets; the collected
   set is saved in ``out/imitation-data.safetensors`` so a rerun does not compute it again;
2. ``steps`` Adam steps, one episode (all its layers) per step, in a seeded order per epoch; gradient
   norm clipped at ``grad_clip``.

It writes the same ``policy.safetensors`` as REINFORCE (``learned(checkpoint=...)`` loads either),
``log.csv`` (step, loss, cumulative seconds including the collection) and ``curve.png``. The steps
are milliseconds each once the set is collected, so the run is short and restarts from scratch when
interrupted after the collection (which is what it keeps).
"""

from __future__ import annotations

import csv
import time
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from kvsieve.engine.cache import sieve_layers
from kvsieve.engine.compress import layer_signals
from kvsieve.engine.reconstruct import ReconstructionPrompt, reconstruction_scores
from kvsieve.files import save_safetensors
from kvsieve.learn.rollout import Episode, context_cache_for
from kvsieve.learn.train_config import TrainResult, derived_seed, episode_index
from kvsieve.models import dtype_name
from kvsieve.networks.checkpoint import load_checkpoint, save_checkpoint
from kvsieve.networks.keep_features import FEATURES, extract
from kvsieve.networks.keep_net import KeepNet, NetConfig
from kvsieve.networks.model_shape import ModelShape

__all__ = ["imitation_targets", "kvzip_reconstruction", "collect", "imitate", "LOG_FIELDS"]

LOG_FIELDS = ("step", "episode", "loss", "seconds")
_EPS = 1e-8


def imitation_targets(scores: torch.Tensor, header: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets, mask) of one layer's (b, h, n) KVzip scores: standardised ``log`` scores on the free entries.

    The free entries are those after the ``header`` and before the last ``window``; elsewhere the mask
    is False (and the target 0). A head whose free scores are all equal gets targets 0.
    """
    n = scores.shape[-1]
    mask = torch.zeros(n, dtype=torch.bool, device=scores.device)
    mask[header: max(header, n - window)] = True
    mask = mask.expand_as(scores)
    logs = torch.log(scores.float().clamp_min(0) + _EPS)
    count = mask.sum(dim=-1, keepdim=True).clamp_min(1)
    mean = (logs * mask).sum(dim=-1, keepdim=True) / count
    var = (((logs - mean) * mask) ** 2).sum(dim=-1, keepdim=True) / count
    targets = torch.where(mask, (logs - mean) / var.sqrt().clamp_min(_EPS), torch.zeros_like(logs))
    return targets, mask


@torch.no_grad()
def kvzip_reconstruction(model, tokenizer, episode: Episode, window: int, hidden_states: bool = False):
    """(full context cache, :class:`~kvsieve.engine.reconstruct.Reconstruction`) of ``episode``: KVzip's teacher
    scores on the whole context, shared by this module and the KVzip surrogate (:mod:`kvsieve.learn.kvzap_train`;
    ``hidden_states``: the cache's layers keep their input hidden states)."""
    cache = context_cache_for(model, episode, window, hidden_states)
    return cache, reconstruction_scores(model, cache, episode.context, ReconstructionPrompt.from_tokenizer(tokenizer))


@torch.no_grad()
def collect(model, tokenizer, episode: Episode, window: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer of ``episode``'s context cache: (features (b, h, n, F), targets (b, h, n), mask (b, h, n))."""
    cache, rebuilt = kvzip_reconstruction(model, tokenizer, episode, window)
    layers = sieve_layers(cache)
    out = []
    for idx, layer in layers:
        features = extract(layer_signals(layer, idx, len(cache.layers), 0, window))
        targets, mask = imitation_targets(rebuilt.scores[idx], rebuilt.header, window)
        out.append((features, targets, mask))
    return out


def _data_key(config, dtype: str) -> str:
    """What the collected set depends on: the feature list too, so a set from older features is recomputed, and the
    dtype the model computes in (``dtype_name``), not the config's, which ``"auto"`` resolves per machine."""
    keep = ("model", "tasks", "length", "samples", "seed", "window", "data")
    return repr({**{k: getattr(config, k) for k in keep}, "dtype": dtype, "features": list(FEATURES)})


def _collect_all(config, model, tokenizer, episodes: list[Episode], out: Path, progress: bool) -> tuple[list, float]:
    """Every episode's layers, from ``out/imitation-data.safetensors`` when it holds this config's set."""
    path = out / "imitation-data.safetensors"
    key = _data_key(config, dtype_name(model))
    if path.is_file():
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
            if meta.get("key") == key:
                tensors = {name: handle.get_tensor(name) for name in handle.keys()}
                data = [[(tensors[f"{e}.{i}.features"], tensors[f"{e}.{i}.targets"], tensors[f"{e}.{i}.mask"])
                         for i in range(int(meta["layers"]))] for e in range(int(meta["episodes"]))]
                return data, float(meta["seconds"])
    start = time.perf_counter()
    data = [collect(model, tokenizer, episode, config.window)
            for episode in tqdm(episodes, desc="kvzip targets", unit="sample", disable=not progress)]
    seconds = time.perf_counter() - start
    tensors = {f"{e}.{i}.{name}": tensor.contiguous() for e, layers in enumerate(data)
               for i, triple in enumerate(layers) for name, tensor in zip(("features", "targets", "mask"), triple)}
    save_safetensors(tensors, path, metadata={"key": key, "episodes": str(len(data)),
                                              "layers": str(len(data[0])), "seconds": repr(seconds)})
    return data, seconds


def imitation_loss(net: KeepNet, layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Mean squared error between the network's logits and the targets over every layer's free entries."""
    total, count = torch.zeros(()), 0
    for features, targets, mask in layers:
        error = (net(features) - targets)[mask]
        total = total + (error ** 2).sum()
        count += error.numel()
    return total / max(count, 1)


def imitate(config, model, tokenizer, episodes: list[Episode], progress: bool = True):
    """Train ``config``'s network by regression on KVzip scores; returns a
    :class:`~kvsieve.learn.train_config.TrainResult`."""
    if tokenizer is None:
        raise ValueError("the imitation objective needs the model's tokenizer (KVzip prompts the model to repeat "
                         "the context)")
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = ModelShape.of(model, config.model)
    data, seconds = _collect_all(config, model, tokenizer, episodes, out, progress)
    with torch.random.fork_rng():
        torch.manual_seed(derived_seed(config.seed, "init"))
        net = KeepNet(NetConfig(hidden=config.hidden))
    optimizer = torch.optim.Adam(net.parameters(), lr=config.lr)
    history = []
    start = time.perf_counter()
    for step in tqdm(range(config.steps), desc="imitate", unit="step", disable=not progress):
        index = episode_index(config, step, len(data))
        optimizer.zero_grad(set_to_none=True)
        loss = imitation_loss(net, data[index])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), config.grad_clip)
        optimizer.step()
        history.append({"step": step, "episode": index, "loss": float(loss.detach()),
                        "seconds": seconds + time.perf_counter() - start})
    net.eval()
    meta = {"model": shape.to_dict(), "net": net.config.to_dict(), "window": config.window,
            "train": config.to_dict(), "step": config.steps, "kvsieve_train": "imitate-kvzip",
            "seconds": seconds + time.perf_counter() - start}
    tensors = {f"net.{k}": v for k, v in net.state_dict().items()}
    policy = save_checkpoint(out / "policy.safetensors", meta, tensors)
    load_checkpoint(policy)  # fail here, not at evaluation, if the file does not read back
    log = out / "log.csv"
    with log.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=LOG_FIELDS)
        writer.writeheader()
        writer.writerows(history)
    curve = _plot_loss(history, out / "curve.png", f"{config.model}: regression on KVzip scores")
    return TrainResult(out, policy, policy, log, curve, config.steps, history)


def _plot_loss(rows: list[dict], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], color="C0")
    ax.set_xlabel("step")
    ax.set_ylabel("MSE to standardised log KVzip score")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

