"""One sample, every cell: model x (policy, ratio) on one request -> one row per cell.

Speed through sharing: in prefill compression the forward pass over the prompt does not depend on
the policy (each layer attends over its full input; only the cache left behind is pruned). So a
sample is prefilled once, every (policy, ratio) cell prunes its own copy of that cache and reads the
question on it, and the cells of one ratio decode their answers together as one batch. Question-aware
cells continue a copy of the full context cache with the question, and prune that. Decode-time cells
(``mode="decode"``) evict while the context is read, so each reads its sample alone.

A failed cell, not a failed run: a policy that raises while it scores and compresses (an error, a program's
budget, NaN or -inf scores, which the engine refuses for every policy, a selection that does not fit the cell's
budget, such as 64 sinks at ratio 0.95) gives a :class:`~kvsieve.harness.store.FailedCell` with the reason in that
cell's place, and the sample's other cells go on. A policy the grid cannot build or that refuses the model is the
grid's configuration: it still stops the run before any work.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import torch
import transformers

import kvsieve
from kvsieve.engine.attach import attach
from kvsieve.engine.cache import cache_bytes, sieve_layers, stack_caches
from kvsieve.engine.generate import generate, greedy_decode
from kvsieve.engine.reader import Capture, PromptRead, read_prompt
from kvsieve.harness.provenance import current as current_provenance
from kvsieve.harness.store import TIMING_CONFIG_KEYS, CellKey, CellResult, FailedCell
from kvsieve.models import dtype_name
from kvsieve.policies.label import Point
from kvsieve.policy import Policy
from kvsieve.prompt import Prompt, build_prompt
from kvsieve.tasks.metrics import score as metric_score
from kvsieve.tasks.sample import Sample

__all__ = ["evaluate_sample"]

MAX_REASON = 500


def _reason(err: BaseException) -> str:
    """``Type: message`` on one line, cut short: what a failed cell stores and the report shows."""
    text = " ".join(str(err).split())
    return (f"{type(err).__name__}: {text}" if text else type(err).__name__)[:MAX_REASON]


def _policy_for(cell: Point, sample: Sample, prompt: Prompt, tokenizer) -> Policy:
    if cell.policy_spec.needs_spans:  # the reference keeps the template header and the answer's tokens
        header = prompt.header_length(tokenizer)
        important = list(range(header)) + prompt.token_positions(tokenizer, [tuple(s) for s in sample.spans])
        return cell.policy_spec.build(important_positions=important)
    policy = cell.policy_spec.build()
    if policy.needs_reconstruction and policy.tokenizer is None:  # KVzip prompts the model
        policy.tokenizer = tokenizer
    return policy


class _SampleRun:
    """One sample's rows as they are made: each cell's row or failure, handed over to ``on_rows`` as they land."""

    def __init__(self, model, tokenizer, sample: Sample, cells: list[Point], model_name: str, shared: bool,
                 config: dict | None, on_rows: Callable[[list[CellResult]], None] | None) -> None:
        self.model, self.tokenizer, self.sample, self.model_name = model, tokenizer, sample, model_name
        self.shared, self.config, self.on_rows = shared, config or {}, on_rows
        self.prompt = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
        self.stop = tuple(sample.stop)
        self.results: list[CellResult | FailedCell] = []
        self.landed = 0
        self.order = {(c.stored, round(c.ratio, 6), c.question_aware): i for i, c in enumerate(cells)}

    def policy(self, cell: Point) -> Policy:
        """The cell's policy, checked against the model: the grid's configuration, refused before any work."""
        policy = _policy_for(cell, self.sample, self.prompt, self.tokenizer)
        policy.check_model(self.model, self.model_name or None)
        return policy

    def key(self, cell: Point) -> CellKey:
        s = self.sample
        return CellKey.of(self.model_name, s.task, s.length, s.id, cell)

    def failed(self, cell: Point, err: BaseException) -> None:
        self.results.append(FailedCell(self.key(cell), _reason(err), dict(
            self.config, policy_digest=cell.policy_spec.digest, cell=cell.as_dict(), sample_seed=self.sample.seed,
            context_tokens=self.prompt.context_ids.shape[1], kvsieve=kvsieve.__version__)))

    def record(self, cell: Point, text: str, kept: int, kept_bytes: int, full_bytes: int, prefill_s: float,
               decode_s: float, timing: dict | None = None) -> None:
        sample, model = self.sample, self.model
        # the dtype the model computed in, not the "auto" that asked for it; in a shared grid ``timing`` holds
        # the sample's own prefill and this cell's compression, timed in one process (the headline's overhead)
        cfg = dict(self.config, **(timing or {}), dtype=dtype_name(model), policy_digest=cell.policy_spec.digest,
                   cell=cell.as_dict(), sample_seed=sample.seed, metric=sample.metric, shared=self.shared,
                   context_tokens=self.prompt.context_ids.shape[1], kvsieve=kvsieve.__version__,
                   transformers=transformers.__version__)
        # stamped where the row is computed: a Ray worker's machine and threads, not the driver's that stores it
        self.results.append(CellResult(self.key(cell), text, metric_score(sample.metric, text, sample.answers),
                                       list(sample.answers), kept, kept_bytes, full_bytes, prefill_s, decode_s, cfg,
                                       current_provenance(cfg["dtype"], str(model.device))))

    def hand_over(self) -> None:
        if self.on_rows is not None and self.landed < len(self.results):
            self.on_rows(self.results[self.landed:])
        self.landed = len(self.results)

    def rows(self) -> list[CellResult | FailedCell]:
        """Every row, in the order of the cells asked for."""
        return sorted(self.results, key=lambda r: self.order[(r.key.policy, round(r.key.ratio, 6),
                                                               r.key.question_aware)])


@torch.no_grad()
def evaluate_sample(model, tokenizer, sample: Sample, cells: list[Point], model_name: str = "", shared: bool = True,
                    config: dict | None = None,
                    on_rows: Callable[[list[CellResult]], None] | None = None) -> list[CellResult]:
    """Evaluate ``cells`` on one sample; shared prefill and batched decoding unless ``shared=False``.

    Returns every row in ``cells`` order; ``on_rows(rows)`` also receives them as they are decoded (each
    decoded batch of one ratio, each unshared cell), so a caller can store them before the sample ends.
    """
    run = _SampleRun(model, tokenizer, sample, cells, model_name, shared, config, on_rows)
    # decode-time eviction happens while the context is read, so nothing is shared between its cells
    _run_alone(run, cells if not shared else [c for c in cells if c.mode.is_decode])
    _run_shared(run, [c for c in cells if shared and not c.mode.is_decode])
    return run.rows()


def _run_alone(run: _SampleRun, cells: list[Point]) -> None:
    """Each cell generates from the sample's text by itself (decode-time eviction, or ``shared=False``)."""
    sample = run.sample
    for cell in cells:
        policy = run.policy(cell)
        try:
            gen = generate(run.model, run.tokenizer, sample.context, sample.question, policy, ratio=cell.ratio,
                           question_aware=cell.question_aware, answer_prefix=sample.answer_prefix,
                           max_new_tokens=sample.max_new_tokens, stop=run.stop, **cell.engine_options)
        except Exception as err:  # noqa: BLE001 - the policy's failure fails its cell, never the run
            run.failed(cell, err)
        else:
            tier = None if cell.mode.recall is None else {
                "hot_bytes": gen.cache_bytes_kept - gen.moved_bytes, "cold_bytes": gen.cold_bytes,
                "moved_bytes": gen.moved_bytes}
            run.record(cell, gen.text, max(gen.kept_tokens), gen.cache_bytes_kept, gen.cache_bytes_full,
                       gen.prefill_seconds, gen.decode_seconds, tier)
        run.hand_over()


def _run_shared(run: _SampleRun, cells: list[Point]) -> None:
    """One read of the context for every cell; per question-awareness, each cell prunes its own copy, then the
    cells of one ratio decode as one batch."""
    if not cells:
        return
    policies = {cell: run.policy(cell) for cell in cells}
    context = read_prompt(run.model, run.prompt.context_ids, Capture.of(policies.values()))
    with attach(run.model, context.capture.policy()):
        for question_aware in (False, True):
            group = [c for c in cells if c.question_aware == question_aware]
            if not group:
                continue
            # reading context + question equals reading the context, then the question on its full cache: the
            # question's queries join the window and the accumulated attention
            read = context.continued(run.prompt.question_ids) if question_aware else context
            batches = _compress_group(run, group, policies, read)
            run.hand_over()  # the failures of this group land before its batches decode
            for items in batches.values():
                _decode_batch(run, items, read.logits if question_aware else None, cache_bytes(read.cache),
                              read.seconds)
                run.hand_over()


def _compress_group(run: _SampleRun, group: list[Point], policies: dict, read: PromptRead) -> dict:
    """Each cell's pruned copy of the read, grouped by ratio: {ratio: [(cell, cache, seconds, kept, bytes)]}. A cell
    whose policy fails here (a budget, NaN scores, a selection that does not fit) is recorded as failed."""
    batches: dict[float, list] = defaultdict(list)  # one batch per ratio: kept lengths are close
    for cell in group:
        logits, tiers = None, None
        try:
            if cell.mode.recall is not None and cell.budget is not None:  # two tiers; the question recalls now
                tiers = read.tiered(policies[cell], cell.ratio, cell.mode.recall)
                cache, report = tiers.question_cache(), tiers.report
                start = time.perf_counter()
                logits = run.model(input_ids=run.prompt.question_ids, cache=cache, use_cache=True,
                                   logits_to_keep=1).logits[:, -1]
                recall_s = time.perf_counter() - start
            else:
                cache, report = read.pruned(policies[cell], cell.budget)
        except Exception as err:  # noqa: BLE001 - the policy's failure fails its cell, never the run
            run.failed(cell, err)
            continue
        kept = max((layer.physical_length for _, layer in sieve_layers(tiers.hot if tiers else cache)), default=0)
        # KVzip: one reconstruction per sample serves all its ratios; each cell is charged its seconds
        seconds = report.seconds if report is not None else 0.0
        tier = {} if tiers is None else {"hot_bytes": tiers.hot_nbytes(), "cold_bytes": tiers.cold_nbytes(),
                                         "moved_bytes": tiers.moved_bytes, "recalled_entries": tiers.recalled,
                                         "recall_seconds": recall_s}
        # a recalling cell holds its hot tier and, while it answers, what its question recalled
        kept_bytes = cache_bytes(cache) if tiers is None else tiers.hot_nbytes() + tiers.moved_bytes
        batches[cell.ratio].append((cell, cache, seconds, kept, kept_bytes, logits, tier))
    return batches


def _decode_batch(run: _SampleRun, items: list, first_logits: torch.Tensor | None, full_bytes: int,
                  prefill_s: float) -> None:
    """Decode one ratio's cells as one batch and record their rows. ``first_logits``: the question's logits
    (question-aware cells, whose caches already hold it); None: each cell reads the question on its own cache."""
    model, tokenizer, prompt = run.model, run.tokenizer, run.prompt
    start = time.perf_counter()
    caches = [stack_caches([item[1]]) for item in items]  # drops attention tracking for decoding
    if first_logits is not None:
        logits = first_logits.expand(len(items), -1)
    else:
        # Each cell reads the question alone: a batched forward of many rows takes other bf16
        # kernels than one row does and flips near-tie first tokens (benchmarks/grid_speed.py). A recalling
        # cell has read it already (its recall happened there).
        logits = torch.cat([item[5] if item[5] is not None else model(
            input_ids=prompt.question_ids, cache=c, use_cache=True, logits_to_keep=1).logits[:, -1]
            for item, c in zip(items, caches)])
    tokens = greedy_decode(model, tokenizer, stack_caches(caches), logits, run.sample.max_new_tokens, run.stop)
    decode_s = (time.perf_counter() - start) / len(items)
    for (cell, _, compress_s, kept, kept_bytes, _, tier), row in zip(items, tokens):
        run.record(cell, tokenizer.decode(row, skip_special_tokens=True), kept, kept_bytes, full_bytes,
                   prefill_s + compress_s, decode_s, dict(zip(TIMING_CONFIG_KEYS, (prefill_s, compress_s)), **tier))
