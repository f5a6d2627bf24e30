"""One evolution run's configuration (the file ``kvsieve evolve --config`` reads) and its dev samples."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kvsieve.config import load_config as load_config_file
from kvsieve.evolve.cascade import FITNESSES
from kvsieve.evolve.seeds import SEEDS
from kvsieve.policies.kvzap import KVzap
from kvsieve.tasks.load import SampleSpec, load_samples

__all__ = ["EvolveConfig", "load_config", "dev_samples"]


@dataclass
class EvolveConfig:
    """One evolution run; the file ``kvsieve evolve --config`` reads (TOML or JSON) has these keys."""

    model: str = "smollm2-135m-instruct"
    tasks: list[str] = field(default_factory=lambda: ["niah_single_1", "niah_single_2", "niah_single_3",
                                                       "niah_multikey_1"])
    length: int = 2048
    ratios: list[float] = field(default_factory=lambda: [0.75, 0.875])
    dev_samples: int = 2  # per task; seeds dev_seed.. (evaluation grids use seeds 0..)
    dev_seed: int = 1000
    heldout_samples: int = 2  # per task, for the dev/held-out gap of the best programs
    heldout_seed: int = 2000
    window: int = 64
    # stage 3 decodes at most this many tokens per answer (None: each task's own limit, 128 for RULER's multivalue
    # needles); a cap above the longest reference answer keeps every correct answer and halves a Qwen candidate,
    # whose stage 3 is mostly multivalue rows that miss a value and decode to the limit
    dev_max_new_tokens: int | None = None
    dtype: str = "auto"
    seed: int = 0
    candidates: int = 200  # programs evaluated (duplicates and unusable proposals do not count)
    time_budget_s: float | None = None
    strategy: str = "evolve"  # or "best_of_n"
    # with strategy "evolve": generations 1..N propose fresh random programs (mutators/random_programs.py, the seed
    # as nominal parent, no score read), the initial population genetic programming starts from; selection and the
    # mutator act from generation N + 1. The random arm with the same seed draws the same first programs.
    random_generations: int = 0
    # "task": the dev score is the decoded answers' task metric (stages 2-3); "likelihood": the graded teacher-forced
    # answer likelihood of every dev cell (stage 2 the last; cascade.likelihood_score), seconds per candidate
    fitness: str = "task"
    # with fitness "likelihood": "all" (every dev sample at every ratio) or "alternate" (each sample at one ratio, the
    # ratios in turn: every budget, half the forward passes)
    dev_cells: str = "all"
    # the kvzap checkpoint behind the features' ``surrogate`` (a shipped name, a file or a `kvsieve train` folder);
    # None: the shipped one of the model. A program found over another surrogate is evaluated with it
    # (``program(path=..., surrogate=...)``)
    surrogate: str | None = None
    islands: int = 2
    per_island: int = 4  # children per island and generation
    migration_interval: int = 5  # generations between copies of each island's best to the next island
    exploit: float = 0.6  # probability that the parent is the island's best (else a random elite)
    inspirations: int = 2
    seed_programs: list[str] = field(default_factory=lambda: ["snapkv"])
    # "structural" | "random" (a fresh random program each time) | "mixed" (structural edits or random terms grafted
    # into the parent, mutators/mixed.py) | "local" | "constrained" (local, decoding under the language's grammar) |
    # "openai"
    mutator: str = "structural"
    local_model: str = "qwen2.5-coder-0.5b-instruct"
    llm_max_new_tokens: int = 384
    llm_base_url: str = ""
    llm_model: str = ""
    llm_api_key_env: str = "OPENAI_API_KEY"
    llm_edit_format: str = "block"
    sandbox_timeout_s: float = 120.0
    sandbox_memory_mb: int = 4096
    max_gap_factor: float = 2.0  # stage 2 rejects a proxy gap above this many times the seeds' worst
    plateau_generations: int = 5
    db: str = "results/evolve/run.sqlite"
    out: str = "results/evolve"
    # the dev set's saved prefills (None: OUT/dev-cache); keyed by content, so runs on the same dev set (an
    # evolution and its best-of-N control) can share one folder; not part of the run's identity
    dev_cache: str | None = None
    sandbox: str = "default"  # "strict": refuse below full isolation (docs/security.md); not part of the identity
    executor: str = "local"  # "local" (this process) or "ray" (ray_candidate_executor.py); not the run's identity
    ray_address: str | None = None  # with executor "ray": None starts a local Ray instance; "auto" or "HOST:PORT"
    workers: int | None = None  # with executor "ray": actors (default: the cluster's CPUs)

    def __post_init__(self) -> None:
        if self.strategy not in ("evolve", "best_of_n"):
            raise ValueError(f"strategy must be 'evolve' or 'best_of_n', got {self.strategy!r}")
        if self.mutator not in ("structural", "random", "mixed", "local", "constrained", "openai"):
            raise ValueError(f"mutator must be 'structural', 'random', 'mixed', 'local', 'constrained' or 'openai', "
                             f"got {self.mutator!r}")
        if self.fitness not in FITNESSES:
            raise ValueError(f"fitness must be one of {FITNESSES}, got {self.fitness!r}")
        if self.dev_cells not in ("all", "alternate"):
            raise ValueError(f"dev_cells must be 'all' or 'alternate', got {self.dev_cells!r}")
        if self.dev_cells == "alternate" and self.fitness != "likelihood":
            raise ValueError("dev_cells 'alternate' needs fitness 'likelihood' (stage 3 decodes every cell)")
        if isinstance(self.random_generations, bool) or not isinstance(self.random_generations, int) \
                or self.random_generations < 0:
            raise ValueError(f"random_generations must be an int >= 0, got {self.random_generations!r}")
        if self.random_generations and self.strategy != "evolve":
            raise ValueError(f"random_generations needs strategy 'evolve' (best-of-N has no population), got "
                             f"{self.random_generations!r} with {self.strategy!r}")
        if self.mutator == "openai" and not (self.llm_base_url and self.llm_model):
            raise ValueError("the openai mutator needs llm_base_url and llm_model (--llm-base-url, --llm-model)")
        if self.surrogate is not None:
            if not isinstance(self.surrogate, str):
                raise ValueError(f"surrogate must be a kvzap checkpoint name or path (a str), got {self.surrogate!r}")
            KVzap(checkpoint=self.surrogate)  # loaded once per process; names a bad value and the shipped ones
        if self.sandbox not in ("default", "strict"):
            raise ValueError(f"sandbox must be 'default' or 'strict', got {self.sandbox!r}")
        for name in ("candidates", "islands", "per_island", "migration_interval", "dev_samples", "heldout_samples",
                     "plateau_generations", "length", "window", "llm_max_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        cap = self.dev_max_new_tokens
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"dev_max_new_tokens must be an int >= 1 or absent (each task's own limit), got {cap!r}")
        unknown = [s for s in self.seed_programs if s not in SEEDS and not Path(s).is_file()]
        if unknown or not self.seed_programs:
            raise ValueError(f"seed programs {unknown or '[]'} are neither seed names ({', '.join(SEEDS)}) nor files")
        if not 0.0 <= self.exploit <= 1.0:
            raise ValueError(f"exploit must be in [0, 1], got {self.exploit!r}")
        if self.executor not in ("local", "ray"):
            raise ValueError(f"executor must be 'local' or 'ray', got {self.executor!r}")
        if self.executor == "local" and (self.ray_address is not None or self.workers is not None):
            raise ValueError("ray_address and workers need executor 'ray' (--executor ray)")
        if self.workers is not None and (isinstance(self.workers, bool) or not isinstance(self.workers, int)
                                         or self.workers < 1):
            raise ValueError(f"workers must be an int >= 1, got {self.workers!r}")

    @property
    def dev_cache_folder(self) -> Path:
        """Where the dev set's prefills are saved and read back (``dev_cache``, else ``OUT/dev-cache``)."""
        return Path(self.dev_cache) if self.dev_cache else Path(self.out) / "dev-cache"

    def identity(self) -> dict:
        """What makes two runs the same run (the database refuses to resume under another)."""
        # the same run anywhere, with any folders and executor
        where = ("db", "out", "dev_cache", "llm_api_key_env", "executor", "ray_address", "workers", "sandbox")
        return {k: v for k, v in asdict(self).items() if k not in where}


def load_config(path: str | None, **overrides) -> EvolveConfig:
    """An :class:`EvolveConfig` from a TOML, JSON or YAML file (unknown keys are an error), then non-None
    overrides; errors name the file (:mod:`kvsieve.config`)."""
    return load_config_file(EvolveConfig, path, **overrides)


def dev_samples(config: EvolveConfig, tokenizer, seed: int, per_task: int):
    """The run's dev (or held-out) samples, their decoding capped at ``dev_max_new_tokens``."""
    spec = SampleSpec(model=config.model, tasks=config.tasks, lengths=[config.length], samples=per_task, seed=seed)
    samples = list(load_samples(spec, tokenizer))
    cap = config.dev_max_new_tokens
    return samples if cap is None else [replace(s, max_new_tokens=min(s.max_new_tokens, cap)) for s in samples]
