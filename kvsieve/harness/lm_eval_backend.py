"""kvsieve inside lm-eval: a model backend, registered as ``kvsieve``, that answers lm-eval's generation
requests with the KV cache compressed by a kvsieve policy, and stores every answer in kvsieve's results store.

Needs the optional extra: ``pip install 'kvsieve[lmeval]'`` (lm-eval 0.4.13 with its ``ruler`` extra).

From the command line (``kvsieve-lm-eval`` is lm-eval's own CLI, same flags, with this backend registered:
lm-eval 0.4.13 has no plugin hook through which the plain ``lm_eval`` command could import it)::

    kvsieve-lm-eval --model kvsieve \\
        --model_args model=qwen2.5-coder-0.5b-instruct,policy=kvzip,ratio=0.75,store=results/lmeval.sqlite \\
        --tasks niah_single_1,ruler_vt --metadata '{"max_seq_lengths": [4096]}' --limit 8

From Python: ``import kvsieve.harness.lm_eval_backend`` registers the backend; then
``lm_eval.simple_evaluate(model="kvsieve", model_args={...}, tasks=[...], metadata=ruler_metadata(model, [4096]))``,
or :func:`evaluate`, which does both. How a prompt is cut into context, question and answer prefix:
``prompt_split.py``; ``kvsieve-lm-eval export`` (many policies at once, one prefill a request): ``lm_eval_export.py``.

**Rows.** Each answered request lands in the store (``store=``, default ``results/lmeval.sqlite``;
``store=none``: none) as one row: task ``lmeval:TASK``, length the document's ``max_length`` (RULER's target
length; else the ``length=`` argument), sample id ``DOCID-SHA`` (the prompt's sha256, so a row is reused
only for the very same prompt), score RULER's ``string_match_all`` x100 against the document's ``outputs``
(lm-eval's own RULER metric; documents without ``outputs`` get no row). A rerun reuses stored rows, so an
interrupted lm-eval run resumes; ``kvsieve report --headline`` and ``kvsieve certify`` read the rows.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lm_eval
import torch
from lm_eval.__main__ import cli_evaluate
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm
from transformers import AutoTokenizer

from kvsieve.bundled import canonical_name
from kvsieve.harness.content import check_dtype, check_store
from kvsieve.harness.evaluate import evaluate_sample
from kvsieve.harness.lm_eval_export import export_samples, length_lines, reference_answers, ruler_metadata, sample_for
from kvsieve.harness.prompt_split import split_prompt
from kvsieve.harness.store import CellKey, CellResult, ResultsStore
from kvsieve.models import dtype_name, load, local_source
from kvsieve.policies.label import FULL_CACHE, Mode, Point
from kvsieve.policies.registry import parse
from kvsieve.recall import Recall
from kvsieve.tasks.sample import read_jsonl

__all__ = ["KvsieveLM", "evaluate", "main"]

DEFAULT_STORE = "results/lmeval.sqlite"


@register_model("kvsieve")
class KvsieveLM(LM):
    """lm-eval's ``LM`` answering ``generate_until`` requests with a compressed cache (see the module docstring).

    ``model``: a bundled name, a HF folder or hub id; ``policy``: a kvsieve spec (``full``, ``kvzip``,
    ``kvzap(checkpoint='...')``, ``program:PATH``; lm-eval splits ``--model_args`` on commas, so a spec with
    several parameters needs the Python API); ``ratio``: the fraction of the cache removed; ``qa``: ``auto``
    (the split rule) or ``always``; ``store``: the results store, or ``none``; ``length``: the row length of
    documents without ``max_length``; ``threads``: torch threads; ``tokenizer``: read by lm-eval's RULER
    generators, ignored here; ``recall``: a fraction (``recall=0.025``) or ``recall(fraction=..., ...)``, the
    point's two tiers (``kvsieve/recall.py``; a request whose question cannot be split off runs question-aware,
    without recall). Of lm-eval's own options ``device`` is honoured; requests are answered one at a
    time whatever ``batch_size`` says (each has its own compressed cache).
    """

    def __init__(self, model: str, policy: str = FULL_CACHE, ratio: float = 0.0, qa: str = "auto",
                 store: str | None = DEFAULT_STORE, dtype: str = "auto", length: int = 0,
                 threads: int | None = None, tokenizer: str | None = None, recall: str | float | None = None,
                 **lm_eval_options: Any) -> None:
        super().__init__()
        unknown = sorted(set(lm_eval_options) - {"batch_size", "max_batch_size", "device"})
        if unknown:
            raise ValueError(f"kvsieve backend: unknown model_args {', '.join(unknown)}; it takes model, policy, "
                             "ratio, qa, store, dtype, length, threads, tokenizer, recall")
        if threads is not None:
            torch.set_num_threads(int(threads))
        self.model_name = canonical_name(str(model))
        mode = Mode() if recall in (None, "", "none") else Mode(recall=Recall.parse_setting(recall))
        point = Point(parse(str(policy)), float(ratio), False, mode)  # the point checks the ratio and the recall
        self.cell = point if point.compresses else point.at(0.0)  # the full cache: once, at ratio 0
        split_prompt("x", qa=qa)  # checks qa before the model loads
        self.qa, self.length = qa, int(length)
        # lm-eval's --device (cpu, cuda, cuda:N) is where the model runs; None: kvsieve's default (KVSIEVE_DEVICE)
        self.model, self.tokenizer = load(self.model_name, dtype=dtype, device=lm_eval_options.get("device"))
        self.store = None if store in (None, "", "none", "None") else ResultsStore(Path(str(store)))
        if self.store is not None:
            try:
                check_store(self.store, self.model_name, {self.cell.stored: self.cell.policy_spec.digest})
                check_dtype(self.store, self.model_name, dtype_name(self.model))
            except ValueError:
                self.store.close()
                raise
        self.unscored = 0  # answered requests whose documents carry no reference answers (no row)

    # -- lm-eval's interface ----------------------------------------------------------------------------------

    @property
    def tokenizer_name(self) -> str:
        return self.model_name

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        raise ValueError("the kvsieve backend applies the model's chat template itself, after splitting the prompt "
                         "into context and question; run lm-eval without --apply_chat_template")

    def loglikelihood(self, requests: list) -> list[tuple[float, bool]]:
        raise NotImplementedError("the kvsieve backend answers generation tasks (generate_until) only")

    def loglikelihood_rolling(self, requests: list) -> list[float]:
        raise NotImplementedError("the kvsieve backend answers generation tasks (generate_until) only")

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        out = []
        for request in tqdm(requests, disable=disable_tqdm, desc=f"kvsieve {self.cell.stored} @ {self.cell.ratio:g}"):
            prompt, gen_kwargs = request.args
            text = self.answer(prompt, dict(gen_kwargs or {}), request.doc or {}, str(request.task_name),
                               request.doc_id)
            self.cache_hook.add_partial("generate_until", request.args, text)
            out.append(text)
        return out

    # -- one request ------------------------------------------------------------------------------------------

    def answer(self, prompt: str, gen_kwargs: dict, doc: dict, task: str, doc_id: int | None) -> str:
        """The answer to one lm-eval request, from the store when this very prompt was answered before."""
        if gen_kwargs.get("do_sample"):
            raise ValueError("the kvsieve backend decodes greedily; the task asks for sampling (do_sample=true)")
        sample, split = sample_for(prompt, gen_kwargs, doc, task, doc_id, self.qa, self.length)
        answers, digest = reference_answers(doc), sample.id.rpartition("-")[2]
        # the full cache is one reference for every cell, question-aware or not (Point.reference has no +qa)
        aware = split.question_aware and self.cell.compresses
        cell = Point(self.cell.policy_spec, self.cell.ratio, aware, Mode() if aware else self.cell.mode)
        key = CellKey.of(self.model_name, sample.task, sample.length, sample.id, cell)
        if self.store is not None and answers is not None:
            stored = self.store.rows(model=key.model, task=key.task, length=key.length, sample_id=key.sample_id,
                                     policy=key.policy, ratio=key.ratio, question_aware=key.question_aware)
            if stored:
                return stored[0].prediction
        config = {"lm_eval": {"task": task, "doc_id": doc_id, "split": split.rule, "version": lm_eval.__version__,
                              "prompt_sha256": digest, "gen_kwargs": {k: v for k, v in gen_kwargs.items()
                                                                      if isinstance(v, (str, int, float, bool, list))}}}
        rows: list[CellResult] = evaluate_sample(self.model, self.tokenizer, sample, [cell], self.model_name,
                                                 config=config)
        if self.store is not None and answers is not None:
            self.store.add_many(rows)
        elif answers is None:
            self.unscored += 1
        return rows[0].prediction


def evaluate(model: str, tasks: Sequence[str], policy: str = FULL_CACHE, ratio: float = 0.0,
             lengths: Sequence[int] = (), limit: int | None = None, **model_args: Any) -> dict:
    """lm-eval's ``simple_evaluate`` with this backend: ``tasks`` under ``policy`` at ``ratio``; RULER tasks are
    built at ``lengths`` with the model's tokenizer. Returns lm-eval's results dict."""
    args = {"model": model, "policy": policy, "ratio": ratio, **model_args}
    metadata = ruler_metadata(model, lengths) if lengths else {}
    return lm_eval.simple_evaluate(model="kvsieve", model_args=args, tasks=list(tasks), limit=limit,
                                   metadata=metadata)


def _with_tokenizer(argv: list[str]) -> list[str]:
    """``argv`` with ``tokenizer=FOLDER`` added to ``--model_args`` for a bundled model that names none, so lm-eval's
    RULER generators read the model's tokenizer offline (they would look its name up on the hub)."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--model_args" and i + 1 < len(out):
            value, at = out[i + 1], i + 1
        elif arg.startswith("--model_args="):
            value, at = arg.partition("=")[2], i
        else:
            continue
        pairs = dict(item.split("=", 1) for item in value.split(",") if "=" in item)
        if "model" in pairs and "tokenizer" not in pairs:
            value += f",tokenizer={local_source(canonical_name(pairs['model']))}"
            out[at] = value if at == i + 1 else f"--model_args={value}"
        break
    return out


def _export(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="kvsieve-lm-eval export", description=export_samples.__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="whose tokenizer sizes RULER's samples (the model evaluated)")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval tasks, e.g. niah_single_1,ruler_vt")
    parser.add_argument("--lengths", required=True, help="comma-separated RULER lengths in tokens")
    parser.add_argument("--limit", type=int, required=True, help="requests per task and length")
    parser.add_argument("--skip", type=int, default=0,
                        help="requests per task left out first (a fresh slice beyond an earlier export's --limit)")
    parser.add_argument("--out", required=True, help="JSONL file for kvsieve eval --data")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    count = export_samples(args.model, [t for t in args.tasks.split(",") if t], lengths, args.limit, args.out,
                           skip=args.skip)
    print(f"wrote {count} samples to {args.out}")
    tokenizer = AutoTokenizer.from_pretrained(ruler_metadata(args.model, lengths)["tokenizer"])
    for line in length_lines(read_jsonl(args.out), lambda text: len(tokenizer(text)["input_ids"])):
        print(line)


def main() -> None:
    """``kvsieve-lm-eval``: lm-eval's command line with the ``kvsieve`` backend registered (same flags);
    ``kvsieve-lm-eval export ...`` writes lm-eval's requests as kvsieve samples (:func:`export_samples`)."""
    if len(sys.argv) > 1 and sys.argv[1] == "export":
        _export(sys.argv[2:])
        return
    sys.argv = _with_tokenizer(sys.argv)
    cli_evaluate()


if __name__ == "__main__":
    main()
