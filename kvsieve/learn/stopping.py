"""The stopping rule, fixed in the training config before the run: held-out KL every ``eval_every`` steps, stop
after ``patience`` evaluations in a row that do not beat the best by more than ``min_delta``; the policy kept is the
best evaluated one (the warm start, step 0, included, so a run that never improves ships its warm start).
``patience_from``: evaluations before this step do not count towards the patience (they may still be the best): a
budget curriculum first *raises* the held-out KL as it opens the small budgets (issue 51: seed 5200 stopped inside
that transient at step 50), so a rule can start counting after the ramp, e.g. at ``curriculum_steps + 20``.

A pure function of the evaluation history (a list of ``(step, mean held-out KL)``), so a resumed run, which reads
its history back from ``heldout.csv``, takes exactly the decisions an uninterrupted one does.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StoppingRule", "Verdict"]


@dataclass(frozen=True)
class Verdict:
    best_step: int
    best_kl: float
    since_best: int  # evaluations after the best one
    stop: bool


@dataclass(frozen=True)
class StoppingRule:
    patience: int = 0  # 0: never stop early (run to ``steps``)
    min_delta: float = 0.0  # an evaluation must beat the best by more than this to count as better
    patience_from: int = 0  # evaluations at earlier steps are not counted towards the patience

    def __post_init__(self) -> None:
        if isinstance(self.patience, bool) or not isinstance(self.patience, int) or self.patience < 0:
            raise ValueError(f"patience must be an int >= 0, got {self.patience!r}")
        if isinstance(self.min_delta, bool) or not isinstance(self.min_delta, (int, float)) or self.min_delta < 0:
            raise ValueError(f"min_delta must be a number >= 0, got {self.min_delta!r}")
        if isinstance(self.patience_from, bool) or not isinstance(self.patience_from, int) or self.patience_from < 0:
            raise ValueError(f"patience_from must be an int >= 0, got {self.patience_from!r}")

    def verdict(self, history: list[tuple[int, float]]) -> Verdict:
        """The best step so far and whether to stop, from the evaluations in step order."""
        if not history:
            raise ValueError("the stopping rule needs at least one evaluation")
        best_step, best_kl, since = history[0][0], history[0][1], 0
        for step, kl in history[1:]:
            if kl < best_kl - self.min_delta:
                best_step, best_kl, since = step, kl, 0
            elif step >= self.patience_from:
                since += 1
        return Verdict(best_step, best_kl, since, self.patience > 0 and since >= self.patience)
