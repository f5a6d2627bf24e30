"""REINFORCE on the per-step KL reward (DistillCache), resumable, seeded: ``kvsieve train``'s default objective.

DistillCache trains its policy network "with REINFORCE via a per-step KL-divergence reward"
(DistillCache, the paper's abstract). One training step here:

1. picks an episode (a seeded permutation of the training samples per epoch) and a compression ratio
   (``ratios`` in turn); the full-cache teacher of each episode is computed once and cached;
2. runs ``rollouts`` stochastic rollouts (:mod:`kvsieve.learn.rollout`: Gumbel-top-k keep sets, whose
   ordered Plackett-Luce log-probability is exact) and, with ``baseline="greedy"``, one greedy rollout;
3. REINFORCE (Williams 1992) with reward-to-go: every decision time ``t`` gets the advantage
   ``G_t - b_t``, where ``G_t`` is minus the KL summed over the positions from ``t`` on (per scored
   position) and ``b_t`` is the greedy rollout's ``G_t`` (self-critical baseline, Rennie et al. 2017,
   arXiv:1612.00563; it does not depend on the sampled actions, so the estimator stays unbiased) or a
   running mean of ``G`` per decision index (``baseline="mean"``, decay ``baseline_decay``);
4. loss = ``-sum_t A_t log p(draws at t) / draws - entropy_coef * H``, where ``draws`` (the number of
   entries drawn in the rollout, a constant for a given episode and ratio) only rescales the gradient
   and ``H`` is the entropy of the Plackett-Luce first draw (the softmax over the free entries),
   divided by ``log`` of their number and averaged over layers, heads and decisions; gradient norm
   clipped at ``grad_clip``; Adam.

Reproducibility: the network's initialisation, the episode order and every rollout's Gumbel noise are
derived from ``seed`` and the step number (no global RNG state), and the checkpoint holds the weights,
Adam's state and the running baseline as tensors, so a run interrupted after any saved step and
restarted with the same command ends with the same weights as an uninterrupted run.

Modes that train: ``decode`` (the sequential problem: evictions after every chunk, reward over the
following tokens) and ``prefill`` (one decision at the end of the context, reward over the
continuation).

What it trains (``network``): DistillCache's network (``keepnet``, per layer and head), or the KVzip
surrogate (``kvzap``: the shipped one or ``init``, fine-tuned in prefill mode, where one compression is
one global Plackett-Luce draw over every layer and head: :mod:`kvsieve.learn.kvzap_rollout`). Keep
logits are the network's output divided by ``temperature`` before the Gumbel noise.

Outputs in ``out``: ``checkpoint.safetensors`` (resumable), ``policy.safetensors`` (weights and
metadata only: what ``learned(checkpoint=...)`` loads, or ``kvzap(checkpoint=...)`` for the surrogate),
``log.csv`` (per step: reward, KL, entropy,
...) and ``curve.png``.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kvsieve.learn.baselines import leave_one_out
from kvsieve.learn.curriculum import active_ratios
from kvsieve.learn.heldout import HeldOut, mean_by_step, read_heldout, write_heldout
from kvsieve.learn.kvzap_rollout import KVzapRolloutPolicy, kvzap_decision_logits
from kvsieve.learn.reward import Teacher
from kvsieve.learn.rollout import (
    Decision,
    Episode,
    Rollout,
    RolloutPolicy,
    context_cache_for,
    decision_terms,
    keepnet_logits,
    rollout,
    step_returns,
    teacher_for,
)
from kvsieve.learn.signal_fit import SignalFit, fit_signal_map
from kvsieve.learn.stopping import StoppingRule
from kvsieve.learn.train_config import (
    RESUMABLE,
    TrainConfig,
    TrainResult,
    derived_seed,
    episode_index,
    seeded_generator,
)
from kvsieve.learn.trust_region import first_draw_kl
from kvsieve.models import dtype_name
from kvsieve.networks.checkpoint import load_checkpoint, save_checkpoint
from kvsieve.networks.keep_net import KeepNet, NetConfig
from kvsieve.networks.kvzap_net import load_kvzap, save_kvzap, with_signals
from kvsieve.networks.model_shape import ModelShape
from kvsieve.networks.shipped import resolve_checkpoint
from kvsieve.selection import Budget

__all__ = ["reinforce", "reinforce_loss", "initial_weights", "check_budget", "plot_curve", "Trainer"]

LOG_FIELDS = ("step", "episode", "ratio", "reward", "kl", "greedy_reward", "baseline", "entropy", "loss",
              "grad_norm", "decisions", "seconds", "policy_ms", "active_ratios", "trust_kl")


def check_budget(config: TrainConfig, episode: Episode, kept: int, ratio: float) -> None:
    protected = max(config.window, config.chunk_size) if config.mode == "decode" else config.window
    if kept <= protected:
        raise ValueError(
            f"compression ratio {ratio} keeps {kept} of the {episode.context.shape[1]} context tokens of "
            f"{episode.name or 'an episode'}, not more than the {protected} entries always kept (window "
            f"{config.window}" + (f", latest chunk {config.chunk_size}" if config.mode == "decode" else "")
            + "): nothing would be chosen; use longer samples, a smaller ratio, window or chunk_size")


def initial_weights(spec: str, shape: ModelShape, net: NetConfig) -> dict[str, torch.Tensor]:
    """The network weights of checkpoint ``spec``, checked against the model and the network being trained."""
    loaded = load_checkpoint(resolve_checkpoint("learned", spec))
    if _other_model(loaded.meta["model"], shape):
        raise ValueError(f"init checkpoint {spec!r} was trained for {loaded.meta['model']}, not {shape.to_dict()}")
    if loaded.meta["net"] != net.to_dict():
        raise ValueError(f"init checkpoint {spec!r} holds a network {loaded.meta['net']}, not {net.to_dict()}; "
                         "use the same hidden size")
    return loaded.group("net")


def initial_kvzap(spec: str, shape: ModelShape) -> tuple[torch.nn.Module, dict]:
    """The KVzip surrogate ``spec`` names (shipped name, file or run folder) and its metadata, checked against
    the model being trained on."""
    net, meta = load_kvzap(resolve_checkpoint("kvzap", spec))
    trained_for = ModelShape(**meta["model"])
    problem = trained_for.mismatch(shape)
    if problem:
        raise ValueError(f"kvzap checkpoint {spec!r} was trained for {trained_for.describe()}, not for the model "
                         f"being trained on: {problem}")
    return net, meta


def _other_model(saved: dict | None, shape: ModelShape) -> bool:
    """Whether a checkpoint's model entry names another model than ``shape``; one written before config
    fingerprints is compared on its name and geometry."""
    if not isinstance(saved, dict):
        return True
    now = shape.to_dict()
    if "fingerprint" not in saved:
        now = {k: now[k] for k in ("name", "num_layers", "num_kv_heads", "head_dim")}
    return saved != now


def reinforce_loss(net: torch.nn.Module, decisions: list[Decision], returns: dict[int, float],
                   baseline: dict[int, float], entropy_coef: float,
                   logits_of=keepnet_logits) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE loss of one rollout and its mean normalised first-draw entropy.

    ``-sum_t (G_t - b_t) log p(draws at t) / draws - entropy_coef * H``: minimising it ascends the
    expected reward (Williams 1992) plus the entropy bonus; ``draws`` is a constant per episode and
    budget, so it only rescales the gradient.
    """
    log_probs, entropy, draws = decision_terms(net, decisions, logits_of)
    pg = torch.zeros(())
    for t, log_prob in log_probs.items():
        pg = pg - (returns.get(t, 0.0) - baseline.get(t, 0.0)) * log_prob
    return pg / max(draws, 1) - entropy_coef * entropy, entropy


class Trainer:
    def __init__(self, config: TrainConfig, model, shape: ModelShape, episodes: list[Episode]) -> None:
        self.config, self.model, self.shape, self.episodes = config, model, shape, episodes
        self.kvzap_meta: dict | None = None  # network "kvzap": the surrogate's checkpoint metadata
        if config.network == "kvzap":
            self.net, self.kvzap_meta = initial_kvzap(config.init or config.model, shape)
            if config.signals:  # the signals' map starts at zero; the policy reads them from this window
                self.net, self.kvzap_meta = with_signals(self.net), dict(self.kvzap_meta, window=config.window)
        else:
            with torch.random.fork_rng():
                torch.manual_seed(derived_seed(config.seed, "init"))
                self.net = KeepNet(NetConfig(hidden=config.hidden))
            if config.init is not None:
                self.net.load_state_dict(initial_weights(config.init, shape, self.net.config))
        # the warm start, frozen: the trust region's reference (the weights before any step, also on resume)
        self.warm = copy.deepcopy(self.net).eval().requires_grad_(False)
        if config.trainable == "bias":  # the output biases: per (layer, head) for the linear variant
            for name, parameter in self.net.named_parameters():
                parameter.requires_grad_(name in ("linear_bias", "mlp_b2"))
        signal_weight = getattr(self.net, "signal_weight", None)
        groups = [{"params": [p for p in self.net.parameters() if p.requires_grad and p is not signal_weight]}]
        if signal_weight is not None:
            groups.append({"params": [signal_weight], "lr": config.signal_lr or config.lr})
        self.optimizer = torch.optim.Adam(groups, lr=config.lr)
        self.baseline = torch.zeros(0, dtype=torch.float64)  # running mean of G per decision index
        self.teachers: dict[int, Teacher] = {}
        self.context_caches: dict = {}  # prefill mode: the context's full cache, once per episode (rollouts clone it)
        self.step = 0
        self._step_logits: dict = {}  # logits_of's memo, emptied every step
        self.remote = None  # where the rollouts run: None here, else a kvsieve.learn.ray_rollouts.RayRollouts

    def rollout_policy(self, generator: torch.Generator | None, record: bool = True, shared: dict | None = None):
        """The network as a policy: Gumbel-perturbed with ``generator``, greedy without; ``shared``: the surrogate's
        scores of one cache, kept for the other rollouts on copies of it with the same weights."""
        c = self.config
        if self.kvzap_meta is not None:
            return KVzapRolloutPolicy(self.net, self.kvzap_meta, c.temperature, generator, record, shared)
        return RolloutPolicy(self.net, self.shape, c.window, generator, record=record, temperature=c.temperature)

    def logits_of(self, net: torch.nn.Module, decision: Decision) -> torch.Tensor:
        if self.kvzap_meta is not None:
            # a step's rollouts share their inputs (copies of one cache): the logits, with their graph, once per step
            key = (id(net), tuple(id(inputs) for _, inputs in decision.features))
            if key not in self._step_logits:
                self._step_logits[key] = kvzap_decision_logits(net, decision, self.kvzap_meta["variant"],
                                                               self.config.temperature)
            return self._step_logits[key]
        return keepnet_logits(net, decision) / self.config.temperature

    # -- checkpoints --------------------------------------------------------------------------------
    def meta(self) -> dict:
        return {"model": self.shape.to_dict(), "net": self.net.config.to_dict(), "window": self.config.window,
                "train": self.config.to_dict(), "step": self.step, "kvsieve_train": "reinforce-kl",
                "network": self.config.network, "dtype": dtype_name(self.model)}

    def tensors(self, with_state: bool) -> dict[str, torch.Tensor]:
        out = {f"net.{k}": v for k, v in self.net.state_dict().items()}
        if with_state:
            if self.config.signal_fit:  # the fitted start is the trust region's reference: kept for a resume
                out.update({f"warm.{k}": v for k, v in self.warm.state_dict().items()})
            for i, p in enumerate(self.net.parameters()):
                for key, value in self.optimizer.state.get(p, {}).items():
                    out[f"optim.{i}.{key}"] = torch.as_tensor(value)
            out["baseline.mean"] = self.baseline
        return out

    def save(self, out: Path, policy: bool = True) -> None:
        save_checkpoint(out / "checkpoint.safetensors", self.meta(), self.tensors(True))
        if policy:
            self.save_policy(out)

    def save_policy(self, out: Path) -> None:
        """``policy.safetensors``: the network now, in the format its policy family loads."""
        if self.kvzap_meta is None:
            save_checkpoint(out / "policy.safetensors", self.meta(), self.tensors(False))
        else:  # what kvzap(checkpoint=OUT) loads: the surrogate's format, its metadata, the fine-tune's record
            kept = {k: v for k, v in self.kvzap_meta.items() if k not in ("format", "net", "sha256", "train")}
            # the surrogate's own training report (its held-out losses) describes the weights before the fine-tune
            kept["init_train"] = self.kvzap_meta.get("train")
            save_kvzap(out / "policy.safetensors", self.net,
                       dict(kept, reinforce={"step": self.step, "train": self.config.to_dict()}))

    def resume(self, path: Path) -> None:
        loaded = load_checkpoint(path)
        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.default is not dataclasses.MISSING}
        # a key absent from an older checkpoint had its default then
        saved = {k: v for k, v in {**defaults, **loaded.meta.get("train", {})}.items() if k not in RESUMABLE}
        now = {k: v for k, v in self.config.to_dict().items() if k not in RESUMABLE}
        changed = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        if changed:
            diff = "; ".join(f"{k}: {saved.get(k)!r} there, {now.get(k)!r} now" for k in changed)
            raise ValueError(f"{path} holds a run with other settings ({diff}); use another out folder or the "
                             f"same settings (only {', '.join(RESUMABLE)} may change on resume)")
        if _other_model(loaded.meta.get("model"), self.shape):
            raise ValueError(f"{path} was trained for {loaded.meta.get('model')}, not {self.shape.to_dict()}")
        # dtype "auto" picks per machine: rewards and baselines from two dtypes would mix in one run
        recorded, now_dtype = loaded.meta.get("dtype"), dtype_name(self.model)
        if recorded is not None and recorded != now_dtype:
            raise ValueError(f"{path} holds a run whose model computed in {recorded}, this one computes in "
                             f"{now_dtype}: pass --dtype {recorded} to resume it, or use another out folder")
        self.net.load_state_dict(loaded.group("net"))
        if self.config.signal_fit:  # (a checkpoint of before signal_affine holds the fitted map alone)
            for name, value in self.warm.state_dict().items():
                if f"warm.{name}" in loaded.tensors:
                    value.copy_(loaded.tensors[f"warm.{name}"])
        params = list(self.net.parameters())
        for key, value in loaded.group("optim").items():
            index, name = key.split(".", 1)
            self.optimizer.state.setdefault(params[int(index)], {})[name] = value.clone()
        self.baseline = loaded.tensors["baseline.mean"].clone()
        self.step = int(loaded.meta["step"])

    def fit_signals(self, progress: bool = False) -> SignalFit:
        """The signal map fitted on the training episodes (:mod:`kvsieve.learn.signal_fit`): the warm start and the
        trust region's reference from now on."""
        c = self.config
        fit = fit_signal_map(self.net, self.kvzap_meta, self.model, self.episodes, c.signal_ridge, progress,
                             c.signal_continuation_weight, c.signal_affine)
        self.warm = copy.deepcopy(self.net).eval().requires_grad_(False)
        return fit

    # -- one step -----------------------------------------------------------------------------------
    def teacher(self, index: int, context_cache) -> Teacher:
        if index not in self.teachers:  # the full-cache distributions do not depend on the policy: once per episode
            c = self.config
            self.teachers[index] = teacher_for(self.model, self.episodes[index], c.mode, c.window, c.chunk_size,
                                               c.teacher_top_k, context_cache)
        return self.teachers[index]

    def step_ratios(self, step: int) -> list[float]:
        """The compression ratios of ``step``: every active one (``all_ratios``) or the active ones in turn."""
        c = self.config
        active = active_ratios(c.ratios, step, c.curriculum_steps)
        return active if c.all_ratios else [active[step % len(active)]]

    def trust_kl(self, decisions: list[Decision]) -> torch.Tensor:
        """Mean first-draw KL from the warm start to the policy over ``decisions`` (with gradients)."""
        terms = []
        for d in decisions:
            with torch.no_grad():
                reference = self.logits_of(self.warm, d)
            terms.append(first_draw_kl(reference, self.logits_of(self.net, d), d.protected))
        return torch.stack(terms).mean() if terms else torch.zeros(())

    def context_cache(self, index: int):
        """Prefill mode: the full cache of episode ``index``'s context, computed once (rollouts clone it)."""
        if index not in self.context_caches:
            self.context_caches[index] = context_cache_for(self.model, self.episodes[index], self.config.window)
        return self.context_caches[index]

    def step_plan(self, step: int, index: int) -> list[tuple[float, int, list[tuple | None]]]:
        """The rollouts of ``step`` on episode ``index``: per ratio, its kept count and each rollout's noise seed
        parts (``None``: the greedy rollout of the greedy baseline, last). Local and remote rollouts share it."""
        c, episode = self.config, self.episodes[index]
        ratios = self.step_ratios(step)
        plan = []
        for ratio in ratios:  # one prefill (the cached context) serves every budget
            kept = Budget(ratio=ratio).resolve(episode.context.shape[1])
            check_budget(c, episode, kept, ratio)
            parts: list[tuple | None] = [(c.seed, "noise", step, r) if len(ratios) == 1 else
                                         (c.seed, "noise", step, ratio, r) for r in range(c.rollouts)]
            plan.append((ratio, kept, parts + ([None] if c.baseline == "greedy" else [])))
        return plan

    def local_rollouts(self, index: int, plan) -> list[list[Rollout]]:
        """Every rollout of ``plan`` in this process, in its order."""
        c, episode = self.config, self.episodes[index]
        context_cache = self.context_cache(index) if c.mode == "prefill" else None
        teacher = self.teacher(index, context_cache)
        shared: dict | None = {} if c.mode == "prefill" else None  # every rollout compresses a copy of one cache
        out = []
        for _, kept, parts in plan:
            group = []
            for p in parts:
                policy = self.rollout_policy(None if p is None else seeded_generator(*p), record=p is not None,
                                             shared=shared)
                group.append(rollout(self.model, episode, policy, c.mode, kept, c.chunk_size, teacher, context_cache))
            out.append(group)
        return out

    def run_step(self) -> dict:
        c, step = self.config, self.step
        start = time.perf_counter()
        index = episode_index(c, step, len(self.episodes))
        ratios = self.step_ratios(step)
        self._step_logits = {}
        plan = self.step_plan(step, index)
        # the rollouts: here, or on Ray actors (kvsieve.learn.ray_rollouts), which give the same Rollouts
        done = self.local_rollouts(index, plan) if self.remote is None else self.remote.rollouts(self, index, plan)
        groups, overhead, greedy_rewards = [], 0.0, []
        for (_, _, parts), results in zip(plan, done):
            samples = [r for p, r in zip(parts, results) if p is not None]
            overhead += sum(s.overhead_seconds for s in samples)
            greedy_returns = {}
            if c.baseline == "greedy":
                greedy = results[-1]
                greedy_returns, reward = step_returns(greedy), greedy.reward
                greedy_rewards.append(reward)
                greedy_returns = {t: greedy_returns.get(t, 0.0) for t in {d.time for s in samples for d in s.decisions}}
            groups.append((samples, greedy_returns))
        self.net.train()
        self.optimizer.zero_grad(set_to_none=True)
        losses, entropies, baselines, returns_by_index, trusts = [], [], [], [], []
        for samples, greedy_returns in groups:
            all_returns = [step_returns(sample) for sample in samples]
            loo = leave_one_out(all_returns) if c.baseline == "loo" else None
            group = []
            for k, (sample, returns) in enumerate(zip(samples, all_returns)):
                times = sorted(returns)
                if c.baseline == "greedy":
                    base = {t: greedy_returns.get(t, 0.0) for t in times}
                elif c.baseline == "loo":
                    base = loo[k]
                else:
                    base = {t: float(self.baseline[i]) if i < len(self.baseline) else 0.0 for i, t in enumerate(times)}
                sample_loss, entropy = reinforce_loss(self.net, sample.decisions, returns, base, c.entropy_coef,
                                                      self.logits_of)
                if c.trust_coef > 0:
                    trust = self.trust_kl(sample.decisions)
                    sample_loss = sample_loss + c.trust_coef * trust
                    trusts.append(float(trust.detach()))
                group.append(sample_loss)
                entropies.append(float(entropy.detach()))
                baselines.append(sum(base.values()) / len(base) if base else 0.0)
                returns_by_index.append([returns[t] for t in times])
            losses.append(torch.stack(group).mean())
        loss = torch.stack(losses).mean()  # every budget's rewards in one update
        if loss.requires_grad:
            loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.net.parameters(), c.grad_clip))
        self.optimizer.step()
        self.net.eval()
        self._step_logits = {}
        if c.baseline == "mean":
            self._update_mean(returns_by_index)
        self.step += 1
        samples = [s for group, _ in groups for s in group]
        rewards = [s.reward for s in samples]
        calls = sum(len(s.decisions) for s in samples)
        return {"step": step, "episode": index, "ratio": max(ratios), "reward": sum(rewards) / len(rewards),
                "kl": -sum(rewards) / len(rewards),
                "greedy_reward": sum(greedy_rewards) / len(greedy_rewards) if greedy_rewards else float("nan"),
                "baseline": sum(baselines) / len(baselines), "entropy": sum(entropies) / len(entropies),
                "loss": float(loss.detach()), "grad_norm": grad_norm, "decisions": calls / len(samples),
                "seconds": time.perf_counter() - start, "policy_ms": 1000 * overhead / max(calls, 1),
                "active_ratios": len(ratios), "trust_kl": sum(trusts) / len(trusts) if trusts else float("nan")}

    def _update_mean(self, returns_by_index: list[list[float]]) -> None:
        width = max((len(r) for r in returns_by_index), default=0)
        if width > len(self.baseline):
            self.baseline = torch.cat([self.baseline, torch.full((width - len(self.baseline),), math.nan,
                                                                 dtype=torch.float64)])
        decay = self.config.baseline_decay
        for i in range(width):
            values = [r[i] for r in returns_by_index if i < len(r)]
            mean = sum(values) / len(values)
            old = float(self.baseline[i])
            self.baseline[i] = mean if math.isnan(old) else decay * old + (1 - decay) * mean
        self.baseline = torch.nan_to_num(self.baseline, nan=0.0)


def _read_log(path: Path, before: int) -> list[dict]:
    if not path.is_file():
        return []
    with path.open(newline="") as fh:
        rows = [row for row in csv.DictReader(fh) if int(row["step"]) < before]
    return [{k: (float(v) if k not in ("step", "episode") else int(v)) for k, v in row.items() if v != ""}
            for row in rows]


def _write_log(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=LOG_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k, "") for k in LOG_FIELDS})


def plot_curve(rows: list[dict], path: Path, title: str = "", heldout: list[dict] | None = None,
               best_step: int | None = None) -> Path:
    """Reward (minus mean KL per token) and first-draw entropy per step; a moving average over 10 steps; with
    ``heldout`` rows, a third panel: the greedy policy's held-out KL per ratio at every evaluated step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = curve_figure(rows, title, heldout, best_step)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def curve_figure(rows: list[dict], title: str = "", heldout: list[dict] | None = None, best_step: int | None = None):
    """The figure :func:`plot_curve` saves (matplotlib's, not closed)."""
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]

    def smooth(values: list[float], width: int = 10) -> list[float]:
        return [sum(values[max(0, i - width + 1): i + 1]) / len(values[max(0, i - width + 1): i + 1])
                for i in range(len(values))]

    panels = 3 if heldout else 2
    fig, axes = plt.subplots(panels, 1, figsize=(7, 2.8 * panels), sharex=True)
    top, bottom = axes[0], axes[1]
    rewards = [r["reward"] for r in rows]
    top.plot(steps, rewards, ".", alpha=0.3, color="C0")
    top.plot(steps, smooth(rewards), color="C0", label="sampled (10-step mean)")
    greedy = [r.get("greedy_reward", math.nan) for r in rows]
    if rows and not all(math.isnan(g) for g in greedy):
        top.plot(steps, smooth(greedy), color="C1", label="greedy (10-step mean)")
    top.set_ylabel("reward = -KL per token")
    top.legend(loc="lower right")
    top.set_title(title or "learned eviction: training curve")
    bottom.plot(steps, [r["entropy"] for r in rows], color="C2")
    bottom.set_ylabel("first-draw entropy / log n")
    for linear in (top, bottom):  # values near 1 would read as "1e-5+9.999e-1" with an offset
        linear.ticklabel_format(axis="y", useOffset=False, style="plain")
    if heldout:
        panel = axes[2]
        for i, ratio in enumerate(sorted({r["ratio"] for r in heldout})):
            points = mean_by_step(heldout, ratio)
            panel.plot([p[0] for p in points], [p[1] for p in points], "o-", color=f"C{i + 3}",
                       label=f"ratio {ratio} ({100 * (1 - ratio):g}% kept)")
        points = mean_by_step(heldout)
        panel.plot([p[0] for p in points], [p[1] for p in points], "k--", label="mean")
        if best_step is not None:
            panel.axvline(best_step, color="grey", linestyle=":", label=f"kept: step {best_step}")
        panel.set_ylabel("held-out KL per token (greedy)")
        panel.set_yscale("log")
        panel.legend(loc="upper right", fontsize=7)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    return fig


def reinforce(config: TrainConfig, model, episodes: list[Episode], progress: bool = True,
              heldout: list[Episode] | None = None, remote=None) -> TrainResult:
    """REINFORCE on the KL reward (the module docstring), resumed from ``config.out`` when it holds a checkpoint.

    With ``config.eval_every`` and ``heldout`` episodes: the greedy policy's held-out KL at step 0 (the warm start)
    and every ``eval_every`` steps (``heldout.csv``), the stopping rule (:mod:`kvsieve.learn.stopping`) and
    ``policy.safetensors`` = the best evaluated step. ``remote``: a :class:`kvsieve.learn.ray_rollouts.RayRollouts`
    that runs the rollouts on Ray actors (started here; the caller closes it), the same training otherwise."""
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(config, model, ModelShape.of(model, config.model), episodes)
    if remote is not None:
        remote.start(config, episodes, config.model, dtype_name(model))
        trainer.remote = remote
    checkpoint = out / "checkpoint.safetensors"
    if checkpoint.is_file():
        trainer.resume(checkpoint)
    elif config.signal_fit:
        (out / "signal_fit.json").write_text(json.dumps(trainer.fit_signals(progress).to_dict(), indent=1) + "\n")
    log_path, curve, heldout_path = out / "log.csv", out / "curve.png", out / "heldout.csv"
    history = _read_log(log_path, trainer.step)
    evaluator = None
    if config.eval_every:
        if not heldout:
            raise ValueError(f"eval_every={config.eval_every} needs held-out episodes")
        evaluator = HeldOut(model, heldout, config.ratios, config.window, config.teacher_top_k)
    rule = StoppingRule(config.patience, config.min_delta, config.patience_from)
    evaluations = read_heldout(heldout_path, trainer.step) if evaluator else []

    def evaluate() -> bool:
        """Held-out KL at this step (unless a saved run already has it); True when the rule says stop."""
        if not any(r["step"] == trainer.step for r in evaluations):
            evaluations.extend(evaluator.evaluate(lambda shared: trainer.rollout_policy(None, False, shared),
                                                  trainer.step))
            if rule.verdict(mean_by_step(evaluations)).best_step == trainer.step:
                trainer.save_policy(out)  # the best so far is what the run ships
            write_heldout(heldout_path, evaluations)
            trainer.save(out, policy=False)
            _write_log(log_path, history)
        return rule.verdict(mean_by_step(evaluations)).stop

    stopped = evaluator is not None and trainer.step % config.eval_every == 0 and evaluate()
    bar = tqdm(total=config.steps, initial=min(trainer.step, config.steps), desc="train", unit="step",
               disable=not progress)
    try:
        while trainer.step < config.steps and not stopped:
            row = trainer.run_step()
            history.append(row)
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward']:.4f}", entropy=f"{row['entropy']:.3f}")
            if evaluator is not None and trainer.step % config.eval_every == 0:
                stopped = evaluate()
            elif trainer.step % config.save_every == 0 or trainer.step == config.steps:
                trainer.save(out, policy=evaluator is None)
                _write_log(log_path, history)
    finally:
        bar.close()
    if not checkpoint.is_file():  # nothing to do (steps already reached by a finished run): still write files
        trainer.save(out, policy=evaluator is None)
    if evaluator is not None and not (out / "policy.safetensors").is_file():
        trainer.save_policy(out)
    _write_log(log_path, history)
    best = rule.verdict(mean_by_step(evaluations)).best_step if evaluations else None
    plot_curve(history, curve, f"{config.model}, {config.mode} mode, ratios {config.ratios}", evaluations, best)
    return TrainResult(out, out / "policy.safetensors", checkpoint, log_path, curve, trainer.step, history)
