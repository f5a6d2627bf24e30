"""The cascade evaluator: a candidate program climbs four stages and stops at the first it fails.

0. static check of the source (``language/static_check.py``: parsed and priced, in this process: nothing
   runs), and the program's ``SELECTION`` against the dev set's real budgets (its sinks and the window must
   fit every cell);
1. invariants on synthetic features, inside the sandbox (``sandbox.py``): shape, dtype, finite,
   deterministic, inputs untouched, selection within budget, also at the dev features' real shapes;
   in the same sandboxed run the program is interpreted on the dev set's cached features, so its
   code never runs in this process (nor anywhere as Python);
2. cheap proxy: the teacher-forced log-likelihood of each dev sample's reference answer on the
   compressed cache against the full cache (nats per answer token; no decoding); a candidate whose
   mean gap exceeds ``max_gap`` is rejected here;
3. task score: greedy decoding on the dev set, scored by the task's metric (a row stops once further tokens
   cannot change its score: a monotone metric at 100, such as RULER's string matching).

With ``fitness="likelihood"`` stage 2 is the last: the candidate's score is graded, not decoded,
:func:`likelihood_score` of its teacher-forced answer log-likelihoods (every dev cell, no threshold), so a
dev set of 64 requests costs seconds and the best programs do not tie the way 0/1 accuracy on a few dozen
requests does (issue 50). Stage 3 (decoding) is then left to held-out evaluation.

A candidate whose compressed dev cells keep exactly the entries an earlier program kept (every layer, head and
cell: :func:`kept_fingerprint`) would compute the same stages 2 and 3 on the same caches: it takes that program's
results (``known``) instead of decoding again.

The dev set is prefilled once (:class:`DevSet`): every candidate prunes copies of the same full-cache
prefills and reads the same saved features. Each (sample, ratio) of a candidate is pruned and reads the
question once: stage 2 teacher-forces the answer on a copy of that cache, stage 3 decodes from it.
Prefill compression is query-agnostic, so the features a candidate sees do not depend on the candidate.

No candidate can stop a run: an exception in this process while handling a candidate's scores
(selection, compression, decoding) rejects the candidate with the reason; only the sandbox failing
on its own (``SandboxUnavailable``, after retries) propagates, and nothing is stored for it.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from kvsieve.engine.attach import attach
from kvsieve.engine.cache import clone_cache, sieve_layers, stack_caches
from kvsieve.engine.cache_file import FORMAT_VERSION as CACHE_FORMAT
from kvsieve.engine.cache_file import load_cache, save_cache
from kvsieve.engine.compress import compress_cache, layer_signals
from kvsieve.engine.generate import greedy_decode
from kvsieve.engine.reader import Capture, read_prompt
from kvsieve.evolve.sandbox import SandboxLimits, run_in_sandbox
from kvsieve.language.program_features import Features, load_features, save_features
from kvsieve.language.program_source import Program, ProgramError
from kvsieve.models import weights_digest
from kvsieve.policies.kvzap import KVzap, shipped_kvzap_for
from kvsieve.policy import Policy
from kvsieve.prompt import Prompt, build_prompt
from kvsieve.selection import Budget, Selection
from kvsieve.signals import Signals
from kvsieve.tasks.metrics import score as metric_score
from kvsieve.tasks.metrics import settled as metric_settled
from kvsieve.tasks.sample import Sample

__all__ = ["DevSet", "Evaluation", "KnownKept", "evaluate_program", "kept_fingerprint", "selection_problem",
           "answer_token_ids", "likelihood_score", "STAGES", "FITNESSES"]

STAGES = ("static", "invariants", "proxy", "task")
# what a candidate's dev score is: "task" the decoded answers' task metric (stage 3), "likelihood" the graded
# teacher-forced answer likelihood (stage 2 as the last stage, :func:`likelihood_score`)
FITNESSES = ("task", "likelihood")


def likelihood_score(logprobs: Iterable[float]) -> float:
    """The graded dev score of ``fitness="likelihood"``: 100 x the mean over dev cells of exp(mean log-probability
    of the reference answer's tokens), i.e. of each cell's geometric-mean probability per answer token, teacher-
    forced on the compressed cache. 0..100 like a task score; a cell that lost the needle contributes ~0, one that
    kept it about what the full cache gives; unlike the mean gap in nats it is not dominated by one lost cell."""
    values = [math.exp(lp) for lp in logprobs]
    if not values:
        raise ValueError("likelihood_score of no dev cells")
    return 100.0 * statistics.fmean(values)


@dataclass
class DevSample:
    sample: Sample
    prompt: Prompt
    cache: object  # the full context cache, never modified (cells prune clones)
    answer_ids: torch.Tensor  # (1, a) reference answer tokens
    full_logprob: float  # mean log-probability of the answer tokens on the full cache
    full_score: float  # task score of the full cache's greedy answer


class _Precomputed(Policy):
    """Scores computed elsewhere (by a candidate inside the sandbox), looked up by layer."""

    name = "precomputed"
    comparable_across_heads = comparable_across_layers = True  # as a program's: its SELECTION normalises or not

    def __init__(self, scores: dict[int, torch.Tensor], selection: Selection, window: int) -> None:
        self.scores = scores
        super().__init__(selection=selection, window=window)

    def score(self, signals: Signals) -> torch.Tensor:
        return self.scores[signals.layer_idx]


def _prefill_key(identity: dict, sample: Sample, prompt: Prompt, answer: torch.Tensor) -> str:
    """sha256 of everything a dev sample's saved prefill and full-cache scores depend on: :meth:`DevSet._identity`,
    its tokens, and how its answer is decoded and scored."""
    tokens = {name: getattr(prompt, name).reshape(-1).tolist() for name in ("context_ids", "question_ids")}
    scoring = [sample.metric, list(sample.answers), sample.max_new_tokens, list(sample.stop)]
    key = json.dumps({**identity, **tokens, "answer": answer.reshape(-1).tolist(), "scoring": scoring},
                     sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def answer_token_ids(tokenizer, sample: Sample) -> torch.Tensor:
    """(1, a) tokens of the reference answer as the model would produce them after the prompt: after an
    answer prefix that does not end in whitespace the answer starts with a space ("is: 42" gives " 42",
    a different first token than "42" alone)."""
    answer = sample.answers[0]
    prefix = sample.answer_prefix or ""
    if prefix and not prefix[-1].isspace() and not answer[:1].isspace():
        answer = " " + answer
    return tokenizer(answer, add_special_tokens=False, return_tensors="pt")["input_ids"]


def _per_row(item: DevSample | list[DevSample], caches: list) -> list[DevSample]:
    """The dev sample of each of ``caches``: ``item`` for every row, or the list given (one per cache)."""
    items = [item] * len(caches) if isinstance(item, DevSample) else list(item)
    if len(items) != len(caches):
        raise ValueError(f"{len(items)} dev samples for {len(caches)} caches: give one per cache")
    return items


class DevSet:
    """Dev samples prefilled once on the full cache, with the features every candidate scores.

    With a ``workdir`` (kept, unlike the default temporary folder) each sample's prefill, features and full-cache
    answer scores are saved there (:mod:`kvsieve.engine.cache_file`), keyed by everything they depend on
    (:func:`_prefill_key`), and a later dev set of the same sample reads them back instead of prefilling."""

    def __init__(self, model, tokenizer, samples: list[Sample], ratios: list[float], window: int = 64,
                 workdir: str | Path | None = None, progress: bool = False, surrogate: str | None = None) -> None:
        if not samples:
            raise ValueError("the dev set is empty")
        for ratio in ratios:
            Budget(ratio=ratio)
        self.model, self.tokenizer, self.ratios, self.window = model, tokenizer, list(ratios), window
        self._full_likelihood: dict[int, float] = {}
        self._tmp = None if workdir is not None else tempfile.TemporaryDirectory(prefix="kvsieve-dev-")
        self.workdir = Path(workdir if workdir is not None else self._tmp.name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        # the features' ``surrogate``: the kvzap checkpoint named (a shipped name or a path), else the shipped one of
        # this model (zeros when none ships for it)
        if surrogate is None:
            self.surrogate = shipped_kvzap_for(model)
        else:
            self.surrogate = KVzap(checkpoint=surrogate)
            self.surrogate.check_model(model)
        self.capture = Capture(window=window,
                               hidden_states=self.surrogate is not None and self.surrogate.needs_hidden_states)
        self.items: list[DevSample] = []
        features: dict[str, Features] = {}
        keep = self._tmp is None  # a kept workdir: each prefill is saved there, and a later run reads it back
        identity = self._identity() if keep else None
        digests = []
        for i, sample in enumerate(tqdm(samples, desc="dev prefills", unit="sample", disable=not progress)):
            prompt = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
            answer = answer_token_ids(tokenizer, sample)
            digests.append(_prefill_key(identity, sample, prompt, answer) if keep else "")
            saved = self.workdir / f"prefill-{digests[-1]}.safetensors" if keep else None
            if saved is not None and saved.is_file():  # prefilled by an earlier run of this dev set
                item, sample_features = self._load_prefill(saved, sample, prompt, answer)
            else:
                item, sample_features = self._prefill(sample, prompt, answer)
                if saved is not None:  # the cache last: its file marks a complete pair
                    save_features(saved.with_suffix(".features"), sample_features)
                    save_cache(saved, item.cache, {"full_logprob": repr(item.full_logprob),
                                                   "full_score": repr(item.full_score)})
            features.update({f"s{i}-{name}": value for name, value in sample_features.items()})
            self.items.append(item)
        self.num_layers = len(sieve_layers(self.items[0].cache))
        # named by the samples it holds: runs sharing a kept workdir never read another dev set's file
        whole = hashlib.sha256("".join(digests).encode()).hexdigest()[:16] if keep else ""
        self.features_path = self.workdir / (f"features-{whole}.safetensors" if keep else "features.safetensors")
        save_features(self.features_path, features)

    def _identity(self) -> dict:
        """What a saved prefill depends on besides its tokens: the model's weights, dtype and code, torch's thread
        count (it orders float sums, as the evolution database's check records), the window, the surrogate (the
        features' ``surrogate``) and the save format."""
        surrogate = None if self.surrogate is None else [self.surrogate.variant, weights_digest(self.surrogate.net)]
        return {"weights": weights_digest(self.model), "dtype": str(self.model.dtype), "torch": torch.__version__,
                "torch_threads": torch.get_num_threads(), "transformers": transformers.__version__,
                "window": self.window, "surrogate": surrogate,
                "hidden_states": self.capture.hidden_states, "format": CACHE_FORMAT}

    def _prefill(self, sample: Sample, prompt: Prompt, answer: torch.Tensor) -> tuple[DevSample, dict[str, Features]]:
        """Prefill one dev sample on the full cache: its cache, features per layer, and full-cache answer scores."""
        cache = read_prompt(self.model, prompt.context_ids, self.capture).cache
        layers = list(sieve_layers(cache))
        features = {}
        for layer_idx, layer in layers:
            signals = layer_signals(layer, layer_idx, len(layers), window=self.window)
            predicted = None if self.surrogate is None else self.surrogate.score(signals)
            features[f"l{layer_idx}"] = Features.from_signals(signals, predicted)
        item = DevSample(sample, prompt, cache, answer, 0.0, 0.0)
        read, logits = self.read_question(item, clone_cache(cache))
        item.full_logprob = self.answer_logprob(item, read, logits)
        item.full_score = self.task_scores(item, [read], logits)[0]
        return item, features

    def _load_prefill(self, path: Path, sample: Sample, prompt: Prompt,
                      answer: torch.Tensor) -> tuple[DevSample, dict[str, Features]]:
        cache, meta = load_cache(path, self.model.config)
        item = DevSample(sample, prompt, cache, answer, float(meta["full_logprob"]), float(meta["full_score"]))
        return item, load_features(path.with_suffix(".features"))

    @property
    def full_score(self) -> float:
        return statistics.fmean(item.full_score for item in self.items)  # metric scores are 0..100

    @torch.no_grad()
    def read_question(self, item: DevSample, cache) -> tuple[object, torch.Tensor]:
        """``cache`` (modified in place) after the question, and the (1, vocab) logits of its last token: what
        stage 2 teacher-forces the answer from and stage 3 decodes from, so the question is read once for both."""
        with attach(self.model, self.capture.policy()):
            logits = self.model(input_ids=item.prompt.question_ids, cache=cache, use_cache=True,
                                logits_to_keep=1).logits[:, -1]
        return cache, logits

    @torch.no_grad()
    def answer_logprob(self, item: DevSample, cache, first_logits: torch.Tensor) -> float:
        """Mean log-probability of the reference answer, teacher-forced (stage 2's proxy), on a ``cache`` that has
        read the question (:meth:`read_question`, which gave ``first_logits``); ``cache`` is not modified."""
        answer = item.answer_ids[0]
        logits = first_logits.float()
        if answer.shape[0] > 1:  # the answer's other tokens, each predicted from the ones before it
            with attach(self.model, self.capture.policy()):
                rest = self.model(input_ids=item.answer_ids[:, :-1], cache=clone_cache(cache), use_cache=True).logits[0]
            logits = torch.cat([logits, rest.float()])
        return float(torch.log_softmax(logits, dim=-1).gather(-1, answer[:, None]).mean())

    @torch.no_grad()
    def question_and_answer_logprob(self, item: DevSample, cache) -> float:
        """Mean log-probability of the reference answer on ``cache`` (modified in place) in one forward pass over
        the question and the answer but its last token: what :meth:`read_question` then :meth:`answer_logprob`
        compute, in one call (the graded fitness's cost is this pass, once per dev cell)."""
        answer = item.answer_ids[0]
        ids = torch.cat([item.prompt.question_ids, item.answer_ids[:, :-1]], dim=1)
        with attach(self.model, self.capture.policy()):
            logits = self.model(input_ids=ids, cache=cache, use_cache=True,
                                logits_to_keep=answer.shape[0]).logits[0].float()
        return float(torch.log_softmax(logits, dim=-1).gather(-1, answer[:, None]).mean())

    def full_likelihood(self, index: int) -> float:
        """:meth:`question_and_answer_logprob` of dev sample ``index`` on its full cache (computed once)."""
        if index not in self._full_likelihood:
            self._full_likelihood[index] = self.question_and_answer_logprob(self.items[index],
                                                                            clone_cache(self.items[index].cache))
        return self._full_likelihood[index]

    def cells(self, alternate: bool = False) -> list[tuple[int, float]]:
        """The (sample, ratio) dev cells: every sample at every ratio, or with ``alternate`` each sample at one ratio,
        the ratios taken in turn (sample i at ``ratios[i % len(ratios)]``: every budget, half the passes)."""
        if alternate:
            return [(i, self.ratios[i % len(self.ratios)]) for i in range(len(self.items))]
        return [(i, ratio) for i in range(len(self.items)) for ratio in self.ratios]

    @torch.no_grad()
    def answers(self, item: DevSample | list[DevSample], caches: list,
                first_logits: torch.Tensor | None = None) -> list[str]:
        """The greedy answer decoded on each of ``caches``, as one batch: a decode step reads the weights once for
        every row (as the harness batches a sample's cells); each row decodes as it would alone, and stops once its
        score is settled (a monotone metric at 100, ``tasks.metrics.settled``: a prefix of the harness's answer, the
        same score). ``item``: the dev sample of every row, or one per row (rows of several samples decode together,
        each at its own positions, with its own limit, stop strings and metric). ``first_logits`` (one row per
        cache): the caches have read the question already (:meth:`read_question`)."""
        items = _per_row(item, caches)
        if first_logits is None:  # each row reads the question alone, as one cell of the harness does
            first_logits = torch.cat([self.read_question(it, cache)[1] for it, cache in zip(items, caches)])
        positions = torch.tensor([cache.get_seq_length() for cache in caches])

        def decided(row: int, tokens: list[int]) -> bool:  # this row's answer is over, or its score cannot change
            sample = items[row].sample
            if len(tokens) >= sample.max_new_tokens:
                return True
            if sample.stop and any(stop in self.tokenizer.decode(tokens) for stop in sample.stop):
                return True
            return metric_settled(sample.metric, self.tokenizer.decode(tokens, skip_special_tokens=True),
                                  sample.answers)

        longest = max(it.sample.max_new_tokens for it in items)
        with attach(self.model, self.capture.policy()):
            tokens = greedy_decode(self.model, self.tokenizer, stack_caches(caches), first_logits, longest,
                                   settled=decided, positions=positions)
        return [self.tokenizer.decode(row, skip_special_tokens=True) for row in tokens]

    def task_scores(self, item: DevSample | list[DevSample], caches: list,
                    first_logits: torch.Tensor | None = None) -> list[float]:
        """The task metric of the greedy answer on each of ``caches`` (stage 3); ``item`` and ``first_logits`` as in
        :meth:`answers`."""
        items = _per_row(item, caches)
        return [metric_score(it.sample.metric, text, it.sample.answers)
                for it, text in zip(items, self.answers(items, caches, first_logits))]

    def compressed(self, index: int, policy: Policy, ratio: float):
        """A pruned copy of dev sample ``index``'s full cache."""
        cache = clone_cache(self.items[index].cache)
        compress_cache(cache, policy, Budget(ratio=ratio))
        return cache


@dataclass
class Evaluation:
    """What the cascade found about one candidate. ``stage`` is the last stage passed (-1: none)."""

    status: str  # "ok" | "rejected" | "invalid" | "error" | "killed" | "proxy_rejected"
    stage: int
    reason: str = ""
    proxy: float | None = None  # mean answer log-likelihood gap to the full cache (nats/token, lower is better)
    score: float | None = None  # mean task score (0..100) over dev samples and ratios
    cells: dict[str, float] = field(default_factory=dict)  # "sample/ratio" -> task score
    degenerate: bool = False  # constant scores in every layer: the selection falls back to tie order
    seconds: float = 0.0
    sandbox_seconds: float = 0.0
    kept_hash: str = ""  # kept_fingerprint of its compressed dev cells ("" when it did not reach them)


@dataclass(frozen=True)
class KnownKept:
    """An earlier program's stage 2 and 3 results, for a candidate that keeps exactly its entries."""

    program_id: int
    proxy: float
    score: float | None  # None: it stopped at stage 2 (under an earlier generation's threshold)
    cells: dict[str, float]


def kept_fingerprint(caches: Iterable) -> str:
    """SHA-256 of the original positions each KV head of each layer keeps, cache after cache: equal for two
    compressions of the same full caches exactly when they hold the same entries."""
    digest = hashlib.sha256()
    for cache in caches:
        for _, layer in sieve_layers(cache):
            heads = layer.heads if layer.is_ragged else [layer]  # a dense layer: all heads at once
            for positions, valid in ((h.positions, h.valid) for h in heads):
                kept = positions if valid is None else positions.masked_fill(~valid, -1)
                digest.update(repr(tuple(kept.shape)).encode())
                digest.update(kept.to(torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()


def selection_problem(program: Program, dev: DevSet) -> str:
    """Why the program's ``SELECTION`` cannot run on a dev cell ("" when it fits them all): its sinks
    plus the observation window must fit the budget of every (sample, ratio)."""
    try:
        selection = program.selection(dev.window)
    except (ProgramError, ValueError) as err:
        return f"SELECTION: {err}"
    for i, item in enumerate(dev.items):
        n = int(item.prompt.context_ids.shape[1])
        for ratio in dev.ratios:
            kept = Budget(ratio=ratio).resolve(n)
            protected = int(selection.protected_mask(n, kept).sum())
            if protected > kept:
                return (f"SELECTION {program.selection_params} protects {protected} entries (sinks and the window of "
                        f"{dev.window}) but dev sample {i} ({n} tokens) keeps only {kept} at ratio {ratio}")
    return ""


@torch.no_grad()
def evaluate_program(program: Program, dev: DevSet, limits: SandboxLimits | None = None,
                     max_gap: float | None = None, known: Mapping[str, KnownKept] | None = None,
                     fitness: str = "task", alternate: bool = False) -> Evaluation:
    """Run ``program`` through the cascade on ``dev``. Raises only ``SandboxUnavailable`` (not the
    candidate's doing); everything the candidate causes is an :class:`Evaluation`. ``known``: earlier programs'
    results by :func:`kept_fingerprint`, taken over when the candidate keeps the same entries. ``fitness``: one of
    :data:`FITNESSES` (with "likelihood" ``max_gap`` is not used: there is no stage 3 to save); ``alternate``: each
    dev sample at one ratio (:meth:`DevSet.cells`)."""
    if fitness not in FITNESSES:
        raise ValueError(f"fitness must be one of {FITNESSES}, got {fitness!r}")
    start = time.perf_counter()
    result = run_in_sandbox(program.source, dev.features_path, window=dev.window, limits=limits or SandboxLimits())
    if result.status != "ok":
        stage = -1 if result.status == "rejected" else 0
        return Evaluation(result.status, stage, result.reason, seconds=time.perf_counter() - start,
                          sandbox_seconds=result.seconds)
    problem = selection_problem(program, dev)
    if problem:
        return Evaluation("invalid", 0, problem, seconds=time.perf_counter() - start, sandbox_seconds=result.seconds)
    try:
        if fitness == "likelihood":
            return _likelihood_stage(program, dev, result, start, known or {}, alternate)
        return _stages_2_and_3(program, dev, result, max_gap, start, known or {}, alternate)
    except Exception as err:  # noqa: BLE001 - the candidate's scores broke something here: reject it, go on
        text = " ".join(str(err).split())[:300]
        return Evaluation("error", 1, f"while compressing or decoding with its scores: {type(err).__name__}: {text}",
                          seconds=time.perf_counter() - start, sandbox_seconds=result.seconds)


def _policies(program: Program, dev: DevSet, result) -> tuple[list[Policy], bool]:
    """One policy per dev sample replaying the candidate's sandboxed scores, and whether the scores are
    degenerate (constant within every KV head of every layer: each head falls back to tie order)."""
    selection = program.selection(dev.window)
    degenerate = all(float(s.std(dim=-1).max()) < 1e-9 if s.shape[-1] > 1 else True for s in result.scores.values())
    policies = []
    for i in range(len(dev.items)):
        scores = {layer: result.scores[f"s{i}-l{layer}"] for layer in range(dev.num_layers)}
        policies.append(_Precomputed(scores, selection, dev.window))
    return policies, degenerate


def _likelihood_stage(program: Program, dev: DevSet, result, start: float, known: Mapping[str, KnownKept],
                      alternate: bool) -> Evaluation:
    """``fitness="likelihood"``: each dev cell (:meth:`DevSet.cells`) compressed, its question and answer read in one
    teacher-forced pass; the score is :func:`likelihood_score`, the cells each cell's 100 x exp(mean log-probability),
    the proxy the mean gap to the full cache (nats per answer token)."""
    policies, degenerate = _policies(program, dev, result)
    cells = dev.cells(alternate)
    compressed = [dev.compressed(i, policies[i], ratio) for i, ratio in cells]
    kept_hash = kept_fingerprint(compressed)

    def finish(reason: str = "", **found) -> Evaluation:
        return Evaluation("ok", 2, reason, degenerate=degenerate, kept_hash=kept_hash,
                          seconds=time.perf_counter() - start, sandbox_seconds=result.seconds, **found)

    same = known.get(kept_hash)
    if same is not None and same.score is not None:
        return finish(f"keeps the entries of program #{same.program_id} in every dev cell", proxy=same.proxy,
                      score=same.score, cells=dict(same.cells))
    logprobs, gaps, values = [], [], {}
    for k, (i, ratio) in enumerate(cells):
        logprob = dev.question_and_answer_logprob(dev.items[i], compressed[k])
        compressed[k] = None
        logprobs.append(logprob)
        gaps.append(dev.full_likelihood(i) - logprob)
        values[f"{i}/{ratio}"] = 100.0 * math.exp(logprob)
    return finish(proxy=statistics.fmean(gaps), score=likelihood_score(logprobs), cells=values)


def _stages_2_and_3(program: Program, dev: DevSet, result, max_gap: float | None, start: float,
                    known: Mapping[str, KnownKept], alternate: bool = False) -> Evaluation:
    policies, degenerate = _policies(program, dev, result)
    cells = dev.cells(alternate)  # (sample, ratio), sample by sample
    compressed = [dev.compressed(i, policies[i], ratio) for i, ratio in cells]
    kept_hash = kept_fingerprint(compressed)

    def finish(status: str, stage: int, reason: str = "", **found) -> Evaluation:
        return Evaluation(status, stage, reason, degenerate=degenerate, kept_hash=kept_hash,
                          seconds=time.perf_counter() - start, sandbox_seconds=result.seconds, **found)

    def rejected(proxy: float, why: str = "") -> Evaluation:
        return finish("proxy_rejected", 1, f"answer log-likelihood gap {proxy:.3f} > {max_gap:.3f} nats/token{why}",
                      proxy=proxy)

    same = known.get(kept_hash)
    if same is not None:
        why = f"keeps the entries of program #{same.program_id} in every dev cell"
        if max_gap is not None and same.proxy > max_gap:
            return rejected(same.proxy, f" ({why})")
        if same.score is not None:
            return finish("ok", 3, why, proxy=same.proxy, score=same.score, cells=dict(same.cells))
    # each (sample, ratio) reads the question once; stage 3 decodes from the same caches
    read: list[tuple[object, torch.Tensor]] = []
    gaps = []
    for k, (i, _) in enumerate(cells):
        item = dev.items[i]
        read.append(dev.read_question(item, compressed[k]))
        compressed[k] = None
        gaps.append(item.full_logprob - dev.answer_logprob(item, *read[-1]))
    proxy = statistics.fmean(gaps)
    if max_gap is not None and proxy > max_gap:
        return rejected(proxy)
    # every cell of every sample decodes as one batch: a step reads the weights once for all rows (a Qwen candidate's
    # stage 3 took ~110 of its ~160 s decoding one sample's cells at a time)
    items = [dev.items[i] for i, _ in cells]
    caches, logits = zip(*read)
    read.clear()
    scores = dev.task_scores(items, list(caches), torch.cat(logits))
    values = {f"{i}/{ratio}": score for (i, ratio), score in zip(cells, scores)}
    return finish("ok", 3, proxy=proxy, score=statistics.fmean(values.values()), cells=values)
