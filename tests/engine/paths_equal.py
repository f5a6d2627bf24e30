"""The three ways a user runs one request (``kvsieve eval``'s shared grid, ``generate`` and the server's chunked
prefill), each on SmolLM2 for every shipped policy: what each keeps (the positions every prune leaves) and answers.

Shared by ``test_prompt_reader.py`` and by the command that pinned ``pinned_reads.json`` before the prompt reader
replaced the five capture paths (``python tests/engine/paths_equal.py --pin``)."""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from pathlib import Path

import torch

from kvsieve.engine.attach import attach
from kvsieve.engine.cache import SieveLayer
from kvsieve.engine.generate import generate, greedy_decode
from kvsieve.evolve.seeds import SEEDS
from kvsieve.harness.evaluate import evaluate_sample
from kvsieve.policies.label import Point
from kvsieve.policies.operating_point import OperatingPoint
from kvsieve.policy import FullCache
from kvsieve.prompt import build_prompt
from kvsieve.serve.generation import Prefill
from kvsieve.serve.points import ChosenPoint
from kvsieve.tasks.sample import Sample

PINNED = Path(__file__).with_name("pinned_reads.json")
RATIO = 0.5
MAX_NEW = 12
WORDS = "river garden teacher window mountain letter engine village market candle harbor forest".split()


def sample() -> Sample:
    text = " ".join(f"The {WORDS[i % 12]} near the {WORDS[(i * 5 + 3) % 12]} is quiet." for i in range(40))
    needle = "The special magic number for purple-lake is: 4819273."
    context = text[: len(text) // 2] + " " + needle + " " + text[len(text) // 2:]
    start = context.index("4819273")
    return Sample(task="pin", length=0, id="0", seed=0, context=context,
                  question="What is the special magic number for purple-lake?",
                  answer_prefix="The special magic number for purple-lake is", answers=["4819273"],
                  max_new_tokens=MAX_NEW, metric="string_match_all", spans=[(start, start + 7)])


def specs(program_path: str) -> list[tuple[str, bool]]:
    names = ["adakv", "chunkkv", "expected_attention", "frc", "h2o", "knorm", "kvzip", "pyramidkv", "random", "snapkv",
             "streaming_llm", "tova", "kvzap(checkpoint='smollm2-135m-instruct')",
             "learned(checkpoint='smollm2-135m-instruct')", f"program(path='{program_path}')"]
    return [(name, False) for name in names] + [("snapkv", True), ("tova", True), ("full", False), ("oracle", False)]


class PruneLog:
    """The positions each prune leaves, digested in order: what a path kept, bit for bit."""

    def __init__(self) -> None:
        self.digest = hashlib.sha256()
        self.prunes = 0
        self._original = SieveLayer.prune

    def __enter__(self) -> PruneLog:
        log, original = self, self._original

        def prune(layer, *args, **kwargs):
            original(layer, *args, **kwargs)
            log.prunes += 1
            log.digest.update(layer.positions.contiguous().numpy().tobytes())
            if layer.valid is not None:
                log.digest.update(layer.valid.contiguous().numpy().tobytes())

        SieveLayer.prune = prune
        return self

    def __exit__(self, *exc) -> None:
        SieveLayer.prune = self._original

    def result(self, text: str) -> dict:
        return {"kept": self.digest.hexdigest()[:24], "prunes": self.prunes, "text": text}


def run_eval(model, tokenizer, spec: str, question_aware: bool) -> dict:
    s = sample()
    point = Point(spec, 0.0 if spec == "full" else RATIO, question_aware)
    with PruneLog() as log:
        (row,) = evaluate_sample(model, tokenizer, s, [point], "smollm2-135m-instruct")
    assert not hasattr(row, "reason"), row
    return log.result(row.prediction)


def _policy(point: Point, tokenizer):
    policy = point.policy_spec.build()
    if policy.needs_reconstruction:
        policy.tokenizer = tokenizer
    return policy


def run_generate(model, tokenizer, spec: str, question_aware: bool) -> dict:
    s = sample()
    point = Point(spec, 0.0 if spec == "full" else RATIO, question_aware)
    with PruneLog() as log:
        out = generate(model, tokenizer, s.context, s.question, _policy(point, tokenizer), ratio=point.ratio,
                       question_aware=question_aware, answer_prefix=s.answer_prefix, max_new_tokens=MAX_NEW)
    return log.result(out.text)


def run_serve(model, tokenizer, spec: str, question_aware: bool) -> dict:
    s = sample()
    point = Point(spec, 0.0 if spec == "full" else RATIO, question_aware)
    operating = OperatingPoint.full(fell_back=False) if spec == "full" else OperatingPoint(point,
                                                                                           _policy(point, tokenizer))
    prompt = build_prompt(tokenizer, s.context, s.question, s.answer_prefix)
    with PruneLog() as log:
        prefill = Prefill(model, prompt, ChosenPoint(operating, "uncertified"), MAX_NEW)
        while not prefill.done:
            prefill.advance(10**9)  # the whole prompt in one chunk: the engine's own arithmetic
        cache, logits, _ = prefill.finished()
        with attach(model, FullCache()):  # the server decodes under the engine's attention, evicting nothing
            tokens = greedy_decode(model, tokenizer, cache, logits[None], MAX_NEW)[0]
    return log.result(tokenizer.decode(tokens, skip_special_tokens=True))


PATHS = {"eval": run_eval, "generate": run_generate, "serve": run_serve}


def machine() -> str:
    """What float32 kernels depend on: the CPU's vector extensions and torch's version and threads."""
    flags = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = " ".join(f for f in line.split()[2:] if f.startswith(("avx", "amx", "fma")))
                break
    except OSError:
        pass
    return f"{platform.machine()} {flags} torch {torch.__version__} threads {torch.get_num_threads()}"


if __name__ == "__main__" and sys.argv[1:] == ["--pin"]:
    from kvsieve.models import load

    torch.set_num_threads(1)
    model, tokenizer = load("smollm2-135m-instruct", dtype="float32")
    program = Path("/tmp/kvsieve-pin-program.py")
    program.write_text(SEEDS["frc"])
    rows = {}
    for spec, qa in specs(str(program)):
        for name, run in PATHS.items():
            if spec == "oracle" and name != "eval":  # the answer's spans: only a grid sample carries them
                continue
            key = f"{name} {spec.replace(str(program), 'SEED_FRC')}{' +qa' if qa else ''}"
            rows[key] = run(model, tokenizer, spec, qa)
            print(key, rows[key], flush=True)
    PINNED.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1, sort_keys=True) + "\n")
