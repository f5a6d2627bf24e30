"""What ``kvsieve train`` is told and what it returns: the config, the result, the training episodes.

Shared by every objective (REINFORCE, imitation, the KVzip surrogate). All randomness derives from
``seed`` and the step (:func:`derived_seed`), never from a global RNG state, so a resumed run ends
where an uninterrupted one does.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvsieve.config import load_config as load_config_file
from kvsieve.learn.rollout import Episode
from kvsieve.networks.kvzap_net import INPUTS as KVZAP_INPUTS
from kvsieve.policies.kvzap import KVzap
from kvsieve.policies.learned import LearnedPolicy
from kvsieve.prompt import build_prompt
from kvsieve.tasks import TASKS
from kvsieve.tasks.load import SampleSpec, load_samples, read_samples

__all__ = ["TrainConfig", "TrainResult", "load_config", "episodes_from_samples", "load_episodes", "derived_seed",
           "seeded_generator", "episode_index", "load_heldout", "EVAL_SEEDS_NOTE", "MODES", "OBJECTIVES", "BASELINES",
           "NETWORKS", "RESUMABLE"]

EVAL_SEEDS_NOTE = ("evaluation grids use sample seeds from 0 and evolution dev sets from 1000/2000; training "
                   "defaults to 5000 so its samples are disjoint from both")
MODES = ("decode", "prefill")
OBJECTIVES = ("reinforce", "imitate", "kvzap")
BASELINES = ("greedy", "mean", "loo")
NETWORKS = ("keepnet", "kvzap")
TRAINABLE = ("all", "bias")
# fields that may change when a run is resumed (how long and where, not what it learns)
RESUMABLE = ("steps", "out", "save_every")


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
    # what REINFORCE trains: "keepnet" (DistillCache's network) or "kvzap" (fine-tunes the KVzip surrogate
    # named by ``init``, default the model's shipped one; prefill mode, global allocation: kvsieve.learn.kvzap_rollout)
    network: str = "keepnet"
    # keep logits are scores / temperature before the Gumbel noise (kvzap's log scores spread over a few units)
    temperature: float = 1.0
    # objective "kvzap": what the surrogate reads, "kv" (pre-RoPE keys and values) or "hidden" (KVzap's input)
    kvzap_inputs: str = "kv"
    # one step scores every (active) ratio on the step's request, K = ``rollouts`` rollouts each, all in one update
    # (one context prefill serves them all); False: one ratio per step, ``ratios`` in turn
    all_ratios: bool = False
    # the budget curriculum (kvsieve.learn.curriculum): ratios enter as low + (high - low) * step / curriculum_steps
    # passes them; 0: every ratio from the start
    curriculum_steps: int = 0
    # weight of the trust region: the KL from the warm start's first-draw distribution to the policy's
    # (kvsieve.learn.trust_region); 0: none
    trust_coef: float = 0.0
    # held-out greedy KL every eval_every steps (0: never) on eval_samples requests per task from eval_seed
    # (kvsieve.learn.heldout); the stopping rule (kvsieve.learn.stopping) stops after ``patience`` evaluations
    # without an improvement > min_delta (0: run to ``steps``) and policy.safetensors holds the best evaluated step
    eval_every: int = 0
    eval_samples: int = 2
    eval_seed: int = 6000
    patience: int = 0
    min_delta: float = 0.0
    # evaluations before this step do not count towards ``patience`` (e.g. curriculum_steps + 20: the curriculum
    # first raises the held-out KL); 0: every evaluation counts (the issue-51 runs)
    patience_from: int = 0
    # network "kvzap": which weights REINFORCE moves, "all" or "bias" (the per-layer, per-head output bias only:
    # with global allocation it moves budget between heads and layers and leaves each head's ranking to the surrogate)
    trainable: str = "all"
    # network "kvzap": the policy also reads the paper's signals (DistillCache's window-attention, norm and position
    # features, per head) through a linear map that starts at zero (kvsieve.networks.kvzap_net.with_signals), so
    # step 0 is still the surrogate; ``signal_lr`` is that map's learning rate (None: ``lr``)
    signals: bool = False
    signal_lr: float | None = None
    # with signals: fit the map by ridge regression on the continuation's attention before REINFORCE
    # (kvsieve.learn.signal_fit), so step 0 is the fitted map, not the surrogate; ``signal_ridge`` is the penalty
    signal_fit: bool = False
    signal_ridge: float = 0.01
    # the fit's target is log(exp(s) + signal_continuation_weight * a); signal_affine: it also rescales and shifts
    # each head's surrogate score (kvsieve.learn.signal_fit)
    signal_continuation_weight: float = 1.0
    signal_affine: bool = False

    def __post_init__(self) -> None:
        def positive_int(name: str, minimum: int = 1) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")

        for name in ("length", "steps", "chunk_size", "window", "rollouts", "hidden", "save_every"):
            positive_int(name)
        positive_int("samples", 0)
        for name in ("curriculum_steps", "eval_every", "patience", "patience_from"):
            positive_int(name, 0)
        positive_int("eval_samples")
        if isinstance(self.eval_seed, bool) or not isinstance(self.eval_seed, int):
            raise ValueError(f"eval_seed must be an int, got {self.eval_seed!r}")
        if not isinstance(self.all_ratios, bool):
            raise ValueError(f"all_ratios must be true or false, got {self.all_ratios!r}")
        for name in ("trust_coef", "min_delta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.trainable not in TRAINABLE:
            raise ValueError(f"trainable {self.trainable!r} is not one of {', '.join(TRAINABLE)}")
        if self.trainable != "all" and self.network != "kvzap":
            raise ValueError(f"trainable {self.trainable!r} applies to network 'kvzap', not {self.network!r}")
        if not isinstance(self.signals, bool):
            raise ValueError(f"signals must be true or false, got {self.signals!r}")
        if self.signals and (self.network != "kvzap" or self.trainable != "all"):
            raise ValueError(f"signals apply to network 'kvzap' with trainable 'all', not network {self.network!r} "
                             f"with trainable {self.trainable!r}")
        if self.signal_lr is not None and (not self.signals or isinstance(self.signal_lr, bool)
                                           or not isinstance(self.signal_lr, (int, float))
                                           or not 0 < self.signal_lr <= 1):
            raise ValueError(f"signal_lr must be a number in (0, 1] with signals = true, got {self.signal_lr!r} "
                             f"(signals {self.signals!r})")
        if not isinstance(self.signal_fit, bool) or (self.signal_fit and not self.signals):
            raise ValueError(f"signal_fit must be true or false, and true only with signals = true; got signal_fit "
                             f"{self.signal_fit!r} (signals {self.signals!r})")
        if isinstance(self.signal_ridge, bool) or not isinstance(self.signal_ridge, (int, float)) \
                or not self.signal_ridge > 0:
            raise ValueError(f"signal_ridge must be a number > 0, got {self.signal_ridge!r}")
        if not isinstance(self.signal_affine, bool):
            raise ValueError(f"signal_affine must be true or false, got {self.signal_affine!r}")
        weight = self.signal_continuation_weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0 or (
                (weight != 1.0 or self.signal_affine) and not self.signal_fit):
            raise ValueError(f"signal_continuation_weight must be a number > 0, and it and signal_affine apply only "
                             f"with signal_fit = true; got {weight!r}, signal_affine {self.signal_affine!r} "
                             f"(signal_fit {self.signal_fit!r})")
        if self.baseline == "loo" and self.rollouts < 2:
            raise ValueError(f"baseline 'loo' (leave-one-out) needs rollouts >= 2, got {self.rollouts}")
        if self.eval_every and self.mode != "prefill":
            raise ValueError(f"held-out evaluation (eval_every={self.eval_every}) runs in prefill mode, not "
                             f"{self.mode!r}")
        if self.patience and not self.eval_every:
            raise ValueError(f"patience={self.patience} needs held-out evaluations: set eval_every > 0")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective {self.objective!r} is not one of {', '.join(OBJECTIVES)}")
        if self.network not in NETWORKS:
            raise ValueError(f"network {self.network!r} is not one of {', '.join(NETWORKS)}")
        if self.network == "kvzap" and self.mode != "prefill":
            raise ValueError(f"network 'kvzap' trains in prefill mode only, not {self.mode!r}: the policy gradient "
                             "needs every cached entry's input (its key and value in every KV head), which a cache "
                             "evicted per head no longer holds")
        if self.network == "kvzap" and self.objective != "reinforce":
            raise ValueError(f"network 'kvzap' is fine-tuned by objective 'reinforce', not {self.objective!r} "
                             "(objective 'kvzap' fits the surrogate itself)")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not self.temperature > 0:
            raise ValueError(f"temperature must be a number > 0, got {self.temperature!r}")
        if self.kvzap_inputs not in KVZAP_INPUTS:
            raise ValueError(f"kvzap_inputs {self.kvzap_inputs!r} is not one of {', '.join(map(repr, KVZAP_INPUTS))}")
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
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown:
            raise ValueError(f"unknown task(s) {unknown}; available: {', '.join(TASKS)}")
        if self.samples == 0 and self.data is None:
            raise ValueError("samples=0 needs data=JSONL (otherwise there is nothing to train on)")
        if self.data is not None and not Path(self.data).is_file():
            raise ValueError(f"data file {self.data!r} does not exist")

    @property
    def trains_kvzap(self) -> bool:
        """Whether the run's checkpoint is a KVzip surrogate: fitted (objective ``kvzap``) or fine-tuned by
        REINFORCE (network ``kvzap``); else it is DistillCache's keep network."""
        return self.objective == "kvzap" or self.network == "kvzap"

    @property
    def policy_family(self) -> str:
        """The policy family that runs the checkpoint this run saves (``kvzap`` or ``learned``)."""
        return KVzap.name if self.trains_kvzap else LearnedPolicy.name

    def to_dict(self) -> dict:
        return asdict(self)


def load_config(path: str | None, **overrides) -> TrainConfig:
    """A :class:`TrainConfig` from a TOML, JSON or YAML file (unknown keys are an error), then non-None
    overrides; errors name the file (:mod:`kvsieve.config`)."""
    return load_config_file(TrainConfig, path, **overrides)


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
    out = []
    for sample in samples:
        prompt = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
        answer = tokenizer(sample.answers[0], add_special_tokens=False, return_tensors="pt")["input_ids"]
        out.append(Episode(prompt.context_ids, torch.cat([prompt.question_ids, answer], dim=1), sample.id))
    return out


def load_episodes(config: TrainConfig, tokenizer) -> list[Episode]:
    samples = []
    if config.samples:
        spec = SampleSpec(model=config.model, tasks=config.tasks, lengths=[config.length], samples=config.samples,
                          seed=config.seed)
        samples.extend(load_samples(spec, tokenizer))
    if config.data:
        samples.extend(read_samples(config.data))
    return episodes_from_samples(samples, tokenizer)


def load_heldout(config: TrainConfig, tokenizer) -> list[Episode]:
    """The held-out requests of the stopping rule: ``eval_samples`` per task, seeds from ``eval_seed``."""
    if config.eval_seed <= config.seed < config.eval_seed + config.eval_samples or \
            config.seed <= config.eval_seed < config.seed + config.samples:
        raise ValueError(f"eval_seed {config.eval_seed} overlaps the training seeds {config.seed}.."
                         f"{config.seed + config.samples - 1}: held-out requests must be disjoint")
    spec = SampleSpec(model=config.model, tasks=config.tasks, lengths=[config.length], samples=config.eval_samples,
                      seed=config.eval_seed)
    return episodes_from_samples(list(load_samples(spec, tokenizer)), tokenizer)


def derived_seed(*parts) -> int:
    digest = hashlib.sha256(":".join(str(p) for p in ("kvsieve-train", *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seeded_generator(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(derived_seed(*parts))


def episode_index(config: TrainConfig, step: int, count: int) -> int:
    epoch, offset = divmod(step, count)
    return int(torch.randperm(count, generator=seeded_generator(config.seed, "order", epoch))[offset])
