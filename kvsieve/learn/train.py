"""``kvsieve train``: REINFORCE on the per-step KL reward (DistillCache), resumable, seeded.

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

Outputs in ``out``: ``checkpoint.safetensors`` (resumable), ``policy.safetensors`` (weights and
metadata only: what ``learned(checkpoint=...)`` loads), ``log.csv`` (per step: reward, KL, entropy,
...) and ``curve.png``.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import math
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvsieve.learn.checkpoint import load_checkpoint, save_checkpoint
from kvsieve.learn.kvzap_train import KVzapTrainConfig, train_kvzap
from kvsieve.learn.network import KeepNet, NetConfig
from kvsieve.learn.policy import ModelShape
from kvsieve.learn.reward import Teacher
from kvsieve.learn.rollout import (
    Decision,
    Episode,
    RolloutPolicy,
    context_cache_for,
    decision_terms,
    rollout,
    step_returns,
    teacher_for,
)
from kvsieve.selection import Budget
from kvsieve.tasks.load import SampleSpec, load_samples, read_samples

__all__ = ["TrainConfig", "TrainResult", "train", "load_config", "episodes_from_samples", "reinforce_loss",
           "plot_curve", "EVAL_SEEDS_NOTE"]

EVAL_SEEDS_NOTE = ("evaluation grids use sample seeds from 0 and evolution dev sets from 1000/2000; training "
                   "defaults to 5000 so its samples are disjoint from both")
MODES = ("decode", "prefill")
OBJECTIVES = ("reinforce", "imitate", "kvzap")
BASELINES = ("greedy", "mean")
# fields that may change when a run is resumed (how long and where, not what it learns)
RESUMABLE = ("steps", "out", "save_every")
LOG_FIELDS = ("step", "episode", "ratio", "reward", "kl", "greedy_reward", "baseline", "entropy", "loss",
              "grad_norm", "decisions", "seconds", "policy_ms")


@dataclass
class TrainConfig:
    """One training run. ``ratios`` are compression ratios (0.75 keeps 25% of the context)."""

    model: str = "smollm2-135m-instruct"
    tasks: list[str] = field(default_factory=lambda: ["niah_single_1", "niah_multikey_1", "vt", "qa_1"])
    length: int = 1024
    samples: int = 16  # per task; 0 with ``data``: only the JSONL's samples
    seed: int = 5000
    steps: int = 200
    lr: float = 3e-3
    ratios: list[float] = field(default_factory=lambda: [0.75, 0.5])
    mode: str = "decode"
    chunk_size: int = 128
    window: int = 32
    rollouts: int = 2
    entropy_coef: float = 0.01
    grad_clip: float = 1.0
    baseline: str = "greedy"
    baseline_decay: float = 0.9
    teacher_top_k: int | None = 256
    hidden: int = 64
    out: str = "runs/learned"
    data: str | None = None
    dtype: str = "auto"
    save_every: int = 10
    # "imitate": the supervised ablation, regression on KVzip's scores (kvsieve.learn.imitate); it
    # reads model, tasks, length, samples, seed, steps, lr, window, grad_clip, hidden, out, data, dtype
    # "kvzap": the KVzip surrogate (kvsieve.learn.kvzap_train); it reads model, tasks, length, samples (and as
    # many stdlib text excerpts), seed, steps, lr, hidden, out, dtype
    objective: str = "reinforce"
    # a policy checkpoint (path, run folder or shipped name) whose weights start the run, e.g. an
    # imitation run's: REINFORCE then fine-tunes it. None: the seeded random initialisation
    init: str | None = None

    def __post_init__(self) -> None:
        def positive_int(name: str, minimum: int = 1) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")

        for name in ("length", "steps", "chunk_size", "window", "rollouts", "hidden", "save_every"):
            positive_int(name)
        positive_int("samples", 0)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective {self.objective!r} is not one of {', '.join(OBJECTIVES)}")
        if self.baseline not in BASELINES:
            raise ValueError(f"baseline {self.baseline!r} is not one of {', '.join(BASELINES)}")
        if not isinstance(self.ratios, list) or not self.ratios:
            raise ValueError(f"ratios must be a non-empty list of compression ratios in (0, 1), got {self.ratios!r}")
        for ratio in self.ratios:
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < 1:
                raise ValueError(f"compression ratio {ratio!r} is outside (0, 1) (0.75 keeps 25% of the context)")
        self.ratios = [float(r) for r in self.ratios]
        for name, low, high in (("lr", 0.0, 1.0), ("grad_clip", 0.0, math.inf), ("baseline_decay", 0.0, 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value <= high:
                raise ValueError(f"{name} must be a number in ({low}, {high}], got {value!r}")
        if isinstance(self.entropy_coef, bool) or not isinstance(self.entropy_coef, (int, float)) \
                or self.entropy_coef < 0:
            raise ValueError(f"entropy_coef must be a number >= 0, got {self.entropy_coef!r}")
        if self.teacher_top_k is not None:
            positive_int("teacher_top_k")
        if not isinstance(self.tasks, list) or not all(isinstance(t, str) for t in self.tasks):
            raise ValueError(f"tasks must be a list of RULER task names, got {self.tasks!r}")
        from kvsieve.tasks import TASKS

        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown:
            raise ValueError(f"unknown task(s) {unknown}; available: {', '.join(TASKS)}")
        if self.samples == 0 and self.data is None:
            raise ValueError("samples=0 needs data=JSONL (otherwise there is nothing to train on)")
        if self.data is not None and not Path(self.data).is_file():
            raise ValueError(f"data file {self.data!r} does not exist")

    def to_dict(self) -> dict:
        return asdict(self)


def load_config(path: str | None, **overrides) -> TrainConfig:
    """A TrainConfig from a TOML or JSON file (unknown keys are an error), then non-None overrides."""
    values: dict = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"config file {path} does not exist")
        if file.suffix not in (".toml", ".json"):
            raise ValueError(f"config file {path}: use .toml or .json")
        text = file.read_text(encoding="utf-8")
        values = json.loads(text) if file.suffix == ".json" else tomllib.loads(text)
        allowed = {f.name for f in dataclasses.fields(TrainConfig)}
        unknown = sorted(set(values) - allowed)
        if unknown:
            raise ValueError(f"config file {path}: unknown key(s) {unknown}; allowed: {', '.join(sorted(allowed))}")
    values.update({k: v for k, v in overrides.items() if v is not None})
    return TrainConfig(**values)


@dataclass
class TrainResult:
    out: Path
    policy: Path  # policy.safetensors: load with learned(checkpoint=...)
    checkpoint: Path
    log: Path
    curve: Path
    step: int
    history: list[dict]


def episodes_from_samples(samples, tokenizer) -> list[Episode]:
    """Context = the chat-templated context; continuation = question + answer prefix + first reference answer."""
    from kvsieve.prompt import build_prompt

    out = []
    for sample in samples:
        prompt = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
        answer = tokenizer(sample.answers[0], add_special_tokens=False, return_tensors="pt")["input_ids"]
        out.append(Episode(prompt.context_ids, torch.cat([prompt.question_ids, answer], dim=1), sample.id))
    return out


def _load_episodes(config: TrainConfig, tokenizer) -> list[Episode]:
    samples = []
    if config.samples:
        spec = SampleSpec(model=config.model, tasks=config.tasks, lengths=[config.length], samples=config.samples,
                          seed=config.seed)
        samples.extend(load_samples(spec, tokenizer))
    if config.data:
        samples.extend(read_samples(config.data))
    return episodes_from_samples(samples, tokenizer)


def _derived_seed(*parts) -> int:
    digest = hashlib.sha256(":".join(str(p) for p in ("kvsieve-train", *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _generator(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(_derived_seed(*parts))


def _episode_index(config: TrainConfig, step: int, count: int) -> int:
    epoch, offset = divmod(step, count)
    return int(torch.randperm(count, generator=_generator(config.seed, "order", epoch))[offset])


def _check_budget(config: TrainConfig, episode: Episode, kept: int, ratio: float) -> None:
    protected = max(config.window, config.chunk_size) if config.mode == "decode" else config.window
    if kept <= protected:
        raise ValueError(
            f"compression ratio {ratio} keeps {kept} of the {episode.context.shape[1]} context tokens of "
            f"{episode.name or 'an episode'}, not more than the {protected} entries always kept (window "
            f"{config.window}" + (f", latest chunk {config.chunk_size}" if config.mode == "decode" else "")
            + "): nothing would be chosen; use longer samples, a smaller ratio, window or chunk_size")


def initial_weights(spec: str, shape: ModelShape, net: NetConfig) -> dict[str, torch.Tensor]:
    """The network weights of checkpoint ``spec``, checked against the model and the network being trained."""
    from kvsieve.learn.policy import resolve_checkpoint

    loaded = load_checkpoint(resolve_checkpoint(spec))
    if _other_model(loaded.meta["model"], shape):
        raise ValueError(f"init checkpoint {spec!r} was trained for {loaded.meta['model']}, not {shape.to_dict()}")
    if loaded.meta["net"] != net.to_dict():
        raise ValueError(f"init checkpoint {spec!r} holds a network {loaded.meta['net']}, not {net.to_dict()}; "
                         "use the same hidden size")
    return loaded.group("net")


def _other_model(saved: dict | None, shape: ModelShape) -> bool:
    """Whether a checkpoint's model entry names another model than ``shape``; one written before config
    fingerprints is compared on its name and geometry."""
    if not isinstance(saved, dict):
        return True
    now = shape.to_dict()
    if "fingerprint" not in saved:
        now = {k: now[k] for k in ("name", "num_layers", "num_kv_heads", "head_dim")}
    return saved != now


def reinforce_loss(net: KeepNet, decisions: list[Decision], returns: dict[int, float], baseline: dict[int, float],
                   entropy_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE loss of one rollout and its mean normalised first-draw entropy.

    ``-sum_t (G_t - b_t) log p(draws at t) / draws - entropy_coef * H``: minimising it ascends the
    expected reward (Williams 1992) plus the entropy bonus; ``draws`` is a constant per episode and
    budget, so it only rescales the gradient.
    """
    log_probs, entropy, draws = decision_terms(net, decisions)
    pg = torch.zeros(())
    for t, log_prob in log_probs.items():
        pg = pg - (returns.get(t, 0.0) - baseline.get(t, 0.0)) * log_prob
    return pg / max(draws, 1) - entropy_coef * entropy, entropy


class _Trainer:
    def __init__(self, config: TrainConfig, model, shape: ModelShape, episodes: list[Episode]) -> None:
        self.config, self.model, self.shape, self.episodes = config, model, shape, episodes
        with torch.random.fork_rng():
            torch.manual_seed(_derived_seed(config.seed, "init"))
            self.net = KeepNet(NetConfig(hidden=config.hidden))
        if config.init is not None:
            self.net.load_state_dict(initial_weights(config.init, shape, self.net.config))
        self.optimizer = torch.optim.Adam(self.net.parameters(), lr=config.lr)
        self.baseline = torch.zeros(0, dtype=torch.float64)  # running mean of G per decision index
        self.teachers: dict[int, Teacher] = {}
        self.context_caches: dict = {}  # prefill mode: the context's full cache, once per episode (rollouts clone it)
        self.step = 0

    # -- checkpoints --------------------------------------------------------------------------------
    def meta(self) -> dict:
        return {"model": self.shape.to_dict(), "net": self.net.config.to_dict(), "window": self.config.window,
                "train": self.config.to_dict(), "step": self.step, "kvsieve_train": "reinforce-kl"}

    def tensors(self, with_state: bool) -> dict[str, torch.Tensor]:
        out = {f"net.{k}": v for k, v in self.net.state_dict().items()}
        if with_state:
            for i, p in enumerate(self.net.parameters()):
                for key, value in self.optimizer.state.get(p, {}).items():
                    out[f"optim.{i}.{key}"] = torch.as_tensor(value)
            out["baseline.mean"] = self.baseline
        return out

    def save(self, out: Path) -> None:
        save_checkpoint(out / "checkpoint.safetensors", self.meta(), self.tensors(True))
        save_checkpoint(out / "policy.safetensors", self.meta(), self.tensors(False))

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
        self.net.load_state_dict(loaded.group("net"))
        params = list(self.net.parameters())
        for key, value in loaded.group("optim").items():
            index, name = key.split(".", 1)
            self.optimizer.state.setdefault(params[int(index)], {})[name] = value.clone()
        self.baseline = loaded.tensors["baseline.mean"].clone()
        self.step = int(loaded.meta["step"])

    # -- one step -----------------------------------------------------------------------------------
    def teacher(self, index: int, context_cache) -> Teacher:
        if index not in self.teachers:  # the full-cache distributions do not depend on the policy: once per episode
            c = self.config
            self.teachers[index] = teacher_for(self.model, self.episodes[index], c.mode, c.window, c.chunk_size,
                                               c.teacher_top_k, context_cache)
        return self.teachers[index]

    def run_step(self) -> dict:
        c, step = self.config, self.step
        start = time.perf_counter()
        index = _episode_index(c, step, len(self.episodes))
        episode = self.episodes[index]
        ratio = c.ratios[step % len(c.ratios)]
        kept = Budget(ratio=ratio).resolve(episode.context.shape[1])
        _check_budget(c, episode, kept, ratio)
        context_cache = None
        if c.mode == "prefill":
            if index not in self.context_caches:
                self.context_caches[index] = context_cache_for(self.model, episode, c.window)
            context_cache = self.context_caches[index]
        teacher = self.teacher(index, context_cache)
        samples, overhead = [], 0.0
        for r in range(c.rollouts):
            policy = RolloutPolicy(self.net, self.shape, c.window, _generator(c.seed, "noise", step, r))
            samples.append(rollout(self.model, episode, policy, c.mode, kept, c.chunk_size, teacher, context_cache))
            overhead += samples[-1].overhead_seconds
        greedy_returns, greedy_reward = {}, float("nan")
        if c.baseline == "greedy":
            policy = RolloutPolicy(self.net, self.shape, c.window, None, record=False)
            greedy = rollout(self.model, episode, policy, c.mode, kept, c.chunk_size, teacher, context_cache)
            greedy_returns, greedy_reward = step_returns(greedy), greedy.reward
            greedy_returns = {t: greedy_returns.get(t, 0.0) for t in {d.time for s in samples for d in s.decisions}}
        self.net.train()
        self.optimizer.zero_grad(set_to_none=True)
        losses, entropies, baselines, returns_by_index = [], [], [], []
        for sample in samples:
            returns = step_returns(sample)
            times = sorted(returns)
            if c.baseline == "greedy":
                base = {t: greedy_returns.get(t, 0.0) for t in times}
            else:
                base = {t: float(self.baseline[i]) if i < len(self.baseline) else 0.0 for i, t in enumerate(times)}
            sample_loss, entropy = reinforce_loss(self.net, sample.decisions, returns, base, c.entropy_coef)
            losses.append(sample_loss)
            entropies.append(float(entropy.detach()))
            baselines.append(sum(base.values()) / len(base) if base else 0.0)
            returns_by_index.append([returns[t] for t in times])
        loss = torch.stack(losses).mean()
        if loss.requires_grad:
            loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.net.parameters(), c.grad_clip))
        self.optimizer.step()
        self.net.eval()
        if c.baseline == "mean":
            self._update_mean(returns_by_index)
        self.step += 1
        rewards = [s.reward for s in samples]
        decisions = sum(len(s.decisions) for s in samples) / len(samples)
        calls = sum(len(s.decisions) for s in samples)
        return {"step": step, "episode": index, "ratio": ratio, "reward": sum(rewards) / len(rewards),
                "kl": -sum(rewards) / len(rewards), "greedy_reward": greedy_reward,
                "baseline": sum(baselines) / len(baselines), "entropy": sum(entropies) / len(entropies),
                "loss": float(loss.detach()), "grad_norm": grad_norm, "decisions": decisions,
                "seconds": time.perf_counter() - start, "policy_ms": 1000 * overhead / max(calls, 1)}

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
    return [{k: (float(v) if k not in ("step", "episode") else int(v)) for k, v in row.items()} for row in rows]


def _write_log(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=LOG_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row[k] for k in LOG_FIELDS})


def plot_curve(rows: list[dict], path: Path, title: str = "") -> Path:
    """Reward (minus mean KL per token) and first-draw entropy per step; a moving average over 10 steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]

    def smooth(values: list[float], width: int = 10) -> list[float]:
        return [sum(values[max(0, i - width + 1): i + 1]) / len(values[max(0, i - width + 1): i + 1])
                for i in range(len(values))]

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    rewards = [r["reward"] for r in rows]
    top.plot(steps, rewards, ".", alpha=0.3, color="C0")
    top.plot(steps, smooth(rewards), color="C0", label="sampled (10-step mean)")
    greedy = [r["greedy_reward"] for r in rows]
    if rows and not all(math.isnan(g) for g in greedy):
        top.plot(steps, smooth(greedy), color="C1", label="greedy (10-step mean)")
    top.set_ylabel("reward = -KL per token")
    top.legend(loc="lower right")
    top.set_title(title or "learned eviction: training curve")
    bottom.plot(steps, [r["entropy"] for r in rows], color="C2")
    bottom.set_ylabel("first-draw entropy / log n")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def train(config: TrainConfig, model=None, tokenizer=None, episodes: list[Episode] | None = None,
          progress: bool = True) -> TrainResult:
    """Train (or resume, when ``config.out`` holds a checkpoint of the same settings) up to ``config.steps``.

    ``model``/``tokenizer`` default to ``kvsieve.models.load(config.model)``; ``episodes`` default to the
    generated tasks (seeds from ``config.seed``) plus ``config.data``.
    """
    from tqdm import tqdm

    if config.objective == "kvzap":  # the KVzip surrogate: its own data (RULER + stdlib text) and fit
        result = train_kvzap(KVzapTrainConfig.from_train_config(config), model, tokenizer, progress)
        return TrainResult(result.out, result.policy, result.policy, result.log, result.log, result.step,
                           result.history)
    if model is None:
        from kvsieve.models import load

        model, tokenizer = load(config.model, dtype=config.dtype)
    if episodes is None:
        if tokenizer is None:
            raise ValueError("give a tokenizer (or episodes) to build the training samples")
        episodes = _load_episodes(config, tokenizer)
    if not episodes:
        raise ValueError("no training episodes")
    if config.objective == "imitate":
        from kvsieve.learn.imitate import imitate

        return imitate(config, model, tokenizer, episodes, progress)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    trainer = _Trainer(config, model, ModelShape.of(model, config.model), episodes)
    checkpoint = out / "checkpoint.safetensors"
    if checkpoint.is_file():
        trainer.resume(checkpoint)
    log_path, curve = out / "log.csv", out / "curve.png"
    history = _read_log(log_path, trainer.step)
    bar = tqdm(total=config.steps, initial=min(trainer.step, config.steps), desc="train", unit="step",
               disable=not progress)
    try:
        while trainer.step < config.steps:
            row = trainer.run_step()
            history.append(row)
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward']:.4f}", entropy=f"{row['entropy']:.3f}")
            if trainer.step % config.save_every == 0 or trainer.step == config.steps:
                trainer.save(out)
                _write_log(log_path, history)
    finally:
        bar.close()
    if not checkpoint.is_file():  # nothing to do (steps already reached by a finished run): still write files
        trainer.save(out)
    _write_log(log_path, history)
    plot_curve(history, curve, f"{config.model}, {config.mode} mode, ratios {config.ratios}")
    return TrainResult(out, out / "policy.safetensors", checkpoint, log_path, curve, trainer.step, history)
