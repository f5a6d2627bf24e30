"""``kvsieve``'s command line: the global flags and one argument builder per verb (``kvsieve serve``'s own live in
:mod:`kvsieve.serve.arguments`). Light on purpose: building the parser imports no torch, so ``--help`` answers at
once; :mod:`kvsieve.cli` runs the verbs, and docs/reference.md is generated from this parser."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvsieve.serve.arguments import add_arguments as add_serve_arguments

__all__ = ["VERBS", "build_parser", "add_grid_flags", "add_executor_flags"]

DESCRIPTION = "kvsieve: decide which KV-cache entries to keep, measure, certify and serve the result."


def add_grid_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML or YAML file with GridConfig fields; flags override it")
    parser.add_argument("--model", help="bundled name (smollm2-135m-instruct, qwen2.5-coder-0.5b-instruct, or their "
                        "aliases smollm2-135m, qwen2.5-0.5b), local folder or hub id")
    parser.add_argument("--tasks", help="comma-separated RULER tasks")
    parser.add_argument("--lengths", help="comma-separated context lengths in tokens")
    parser.add_argument("--policies", help="comma-separated policy specs, e.g. full,snapkv,snapkv(window=32)")
    parser.add_argument("--qa-policies", help="policies also run question-aware (reference lines)")
    parser.add_argument("--ratios", help="comma-separated compression ratios in [0, 1)")
    parser.add_argument("--recalls", help="prefill: each compressing policy at each ratio also with these recalls "
                        "(two tiers, kvsieve/recall.py), e.g. recall(fraction=0.025,chunk=32,pool='span'); stored as "
                        "SPEC@recall(...)")
    parser.add_argument("--mode", choices=("prefill", "decode"), help="prefill (default: compress once after the "
                        "context) or decode (evict while the context is read in chunks; stored as SPEC@decodeN)")
    parser.add_argument("--chunk-size", type=int, help="decode mode: context tokens read between evictions "
                        "(default 128)")
    parser.add_argument("--evict-every", type=int, help="decode mode: generated tokens between evictions (default 1: "
                        "after every token; stored as SPEC@decodeNeE, and kvsieve serve evicts such a point's rows "
                        "the same way)")
    parser.add_argument("--samples", type=int, help="samples per task and length (default 5 generated; with "
                        "--data, every sample of the file)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--store", help="SQLite results store")
    parser.add_argument("--data", help="JSONL samples (kvsieve generate format or LongBench) instead of generating")
    parser.add_argument("--dtype", help="auto (default: bfloat16 where the CPU runs it natively, else float32), "
                        "bfloat16 or float32")
    parser.add_argument("--question-aware", action="store_true", help="also run every policy question-aware")
    parser.add_argument("--per-cell", action="store_true", help="naive loop: one prefill per cell (for checks)")
    parser.add_argument("--program-budget", type=float, help="seconds program: policies may spend interpreting, in "
                        "all, over the run in this process (default 3600); then their cells fail")


def add_executor_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--executor", choices=["local", "ray"], help="local (default: this process) or ray "
                        "(long-lived worker processes that each load the model once; pip install 'kvsieve[ray]')")
    parser.add_argument("--ray-address", help="with --executor ray: auto (the cluster this machine is a node of) or "
                        "HOST:PORT of its head; default: start a local Ray instance with this machine's CPUs")
    parser.add_argument("--workers", type=int, help="with --executor ray: worker processes, each holding one copy "
                        "of the model (default: the cluster's CPUs)")


def _eval(parser: argparse.ArgumentParser) -> None:
    add_grid_flags(parser)
    add_executor_flags(parser)


def _report(parser: argparse.ArgumentParser) -> None:
    flag = parser.add_argument
    flag("--store", nargs="+", default=["results/results.sqlite"],
         help="results store; several are pooled (replicate test sets), each cell counted once")
    flag("--model", help="only this model")
    flag("--tasks", help="only these comma-separated tasks")
    flag("--out", help="folder for PNG plots")
    flag("--markdown", action="store_true")
    flag("--headline", action="store_true",
         help="the headline table (markdown): per policy and ratio the mean over requests, its 95%% "
         "bootstrap interval, %% of full, bytes held and compression overhead, paired with full")
    flag("--compare", action="append", default=[], metavar="A,B",
         help="with --headline: the paired difference A - B and its 95%% interval at every ratio both "
         "have (repeatable)")
    flag("--resamples", type=int, default=10_000, help="bootstrap resamples for --headline")
    flag("--mixed-machines", action="store_true", help="pair rows computed on different machines (or "
         "rows of unknown provenance with known ones); refused by default, named in the output when allowed")


def _pick(parser: argparse.ArgumentParser) -> None:
    flag = parser.add_argument
    flag("--config", default="configs/selection.toml", help="the rule (order of criteria, databases)")
    flag("--model", help="only this model")
    flag("--out", help="folder to write MODEL-picked.py into")
    flag("--store", help="also count the policies scored on this results store's requests")
    flag("--json", action="store_true")


def _generate(parser: argparse.ArgumentParser) -> None:
    flag = parser.add_argument
    flag("--model", default="smollm2-135m", help="whose tokenizer measures the length")
    flag("--tasks", required=True)
    flag("--lengths", required=True)
    flag("--samples", type=int, default=5)
    flag("--seed", type=int, default=0)
    flag("--out", required=True)


def _certify(parser: argparse.ArgumentParser) -> None:
    flag = parser.add_argument
    flag("--store", required=True, help="results store holding full-KV and candidate rows")
    flag("--model", required=True)
    flag("--policies", required=True, help="comma-separated candidate policy specs or labels (a label such as "
                                           "pick@recall(fraction=0.025) certifies that recall at every ratio)")
    flag("--ratios", required=True, help="comma-separated compression ratios")
    flag("--alpha", type=float, default=0.1, help="target risk: rate of material degradation")
    flag("--delta", type=float, default=0.1, help="1 - confidence of the guarantee")
    flag("--epsilon", type=float, default=0.0, help="tolerated utility drop, in metric points (0-100)")
    flag("--loss", default="binary", help="binary (degradation > epsilon) or bounded (drop / 100)")
    flag("--correction", default="bonferroni", help="across compressors: bonferroni, holm or split")
    flag("--by", default="none", help="conditional contract: none, task, task_family or length")
    flag("--length-edges", help="with --by length: comma-separated bucket upper edges in tokens")
    flag("--tasks", help="only these tasks (required with --run)")
    flag("--lengths", help="only these lengths (required with --run)")
    flag("--question-aware", action="store_true", help="certify the question-aware variants")
    flag("--run", action="store_true", help="evaluate missing calibration cells through the harness first")
    flag("--samples", type=int, default=25, help="with --run: samples per task and length")
    flag("--seed", type=int, default=0, help="with --run: first sample seed")
    flag("--out", default="contract.json", help="contract file to write")
    add_executor_flags(parser)  # with --run


def _evolve(parser: argparse.ArgumentParser) -> None:
    flag = parser.add_argument
    flag("--config", help="TOML, JSON or YAML file with EvolveConfig keys (kvsieve/evolve/evolve_config.py)")
    flag("--model")
    flag("--candidates", type=int, help="programs to evaluate in all (a resumed run may raise it)")
    flag("--time-budget", type=float, help="stop starting new candidates after this many seconds")
    flag("--seed", type=int)
    flag("--strategy", help="evolve (islands, MAP-Elites) or best_of_n (every child from the seed)")
    flag("--llm", help="mutator: structural (default, offline), random (a control), local (the bundled coder "
                       "model), constrained (local, decoding under the language's grammar) or openai")
    flag("--llm-base-url", help="OpenAI-compatible endpoint, e.g. http://localhost:8000/v1")
    flag("--llm-model", help="model name at that endpoint")
    flag("--llm-api-key-env", help="environment variable holding the API key (default OPENAI_API_KEY)")
    flag("--db", help="program database (SQLite); rerun the same command to resume")
    flag("--out", help="folder for best.py, report.md, progress.png")
    flag("--dev-cache", help="folder of the dev set's saved prefills (default OUT/dev-cache; runs on the "
         "same dev set may share one)")
    flag("--sandbox", choices=("default", "strict"), help="strict: refuse to run unless the sandbox "
         "has full isolation (docs/security.md); default: warn loudly when it is weaker")
    add_executor_flags(parser)


def _train(parser: argparse.ArgumentParser) -> None:
    flag = parser.add_argument
    flag("--config", help="TOML, JSON or YAML file with TrainConfig keys (kvsieve/learn/train_config.py); "
         "flags override")
    flag("--model", help="bundled name, local folder or hub id")
    flag("--tasks", help="comma-separated RULER tasks to generate training samples from")
    flag("--length", type=int, help="context length of the generated samples, in tokens")
    flag("--samples", type=int, help="generated samples per task (0: only --data)")
    flag("--seed", type=int, help="first sample seed and the seed of everything random (default 5000: "
         "disjoint from evaluation seeds)")
    flag("--steps", type=int, help="total training steps (raise it to continue a finished run)")
    flag("--lr", type=float, help="Adam learning rate")
    flag("--ratios", help="comma-separated compression ratios in (0, 1), used in turn (0.75 keeps 25%%)")
    flag("--mode", help="decode (evict after every chunk) or prefill (one eviction after the context)")
    flag("--chunk-size", type=int, help="decode mode: tokens read between evictions")
    flag("--window", type=int, help="observation window: last entries always kept, whose queries the "
         "features read")
    flag("--rollouts", type=int, help="sampled keep sets per step")
    flag("--entropy-coef", type=float, help="weight of the entropy bonus")
    flag("--grad-clip", type=float, help="gradient norm clip")
    flag("--baseline", help="greedy (the deterministic policy's reward) or mean (running mean)")
    flag("--teacher-top-k", type=int, help="tokens kept per teacher distribution (0: the whole vocabulary)")
    flag("--out", help="run folder: checkpoint, policy.safetensors, log.csv, curve.png")
    flag("--data", help="JSONL samples (kvsieve generate format or LongBench) added to the generated ones")
    flag("--dtype", help="auto, bfloat16 or float32")
    flag("--save-every", type=int, help="steps between checkpoints")
    flag("--objective", help="reinforce (the KL reward, default), imitate (regression on KVzip's "
         "scores: the supervised ablation) or kvzap (the per-layer KVzip surrogate, docs/kvzap.md)")
    flag("--hidden", type=int, help="hidden units of the network")
    flag("--init", help="start from this policy checkpoint's weights (path, run folder or shipped name), "
         "e.g. an --objective imitate run")
    flag("--network", help="what REINFORCE trains: keepnet (DistillCache's network, default) or kvzap "
         "(fine-tunes the KVzip surrogate --init names, default the model's shipped one; prefill mode)")
    flag("--temperature", type=float, help="keep logits = scores / temperature before the Gumbel noise "
         "(default 1; e.g. 0.25 for kvzap's log scores)")
    flag("--kvzap-inputs", help="--objective kvzap: what the surrogate reads, kv (pre-RoPE keys and "
         "values, default) or hidden (the hidden state entering each layer, as KVzap)")
    flag("--ray", action="store_true", help="run REINFORCE's rollouts on Ray actors (prefill mode; the same "
         "training, resumable as ever; pip install 'kvsieve[ray]')")
    flag("--ray-address", "--address", dest="ray_address", help="with --ray: auto (the cluster this machine is a "
         "node of) or HOST:PORT of its head; default: start a local Ray instance with this machine's CPUs")
    flag("--workers", type=int, help="with --ray: worker processes, each holding one copy of the model (default: "
         "the cluster's CPUs)")


def _serve(parser: argparse.ArgumentParser) -> None:
    add_serve_arguments(parser)

def _demo(parser: argparse.ArgumentParser) -> None:
    pass  # no flags of its own


VERBS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "eval": ("run an evaluation grid into the results store", _eval),
    "report": ("tables and plots from a results store", _report),
    "pick": ("the selection rule's evolved program per model, from the program databases", _pick),
    "generate": ("write RULER-style samples to JSONL", _generate),
    "certify": ("certify a retention operating point from calibration results; write a contract", _certify),
    "evolve": ("discover an eviction policy by program evolution (resumes from --db)", _evolve),
    "train": ("train a learned eviction policy (REINFORCE on a per-step KL reward; resumes "
                       "from --out)", _train),
    "serve": ("an OpenAI-compatible server applying a certified contract to every request", _serve),
    "demo": ("the default grid on the bundled SmolLM2 (a few minutes on 2 cores)", _demo),
}


def build_parser() -> argparse.ArgumentParser:
    """The whole parser: global flags, then one subcommand per verb of :data:`VERBS`."""
    parser = argparse.ArgumentParser(prog="kvsieve", description=DESCRIPTION)
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: one per core); OpenMP waits "
                        "passively unless OMP_WAIT_POLICY is set")
    parser.add_argument("--device", help="where models run: cpu (default) or cuda / cuda:N, for every verb (sets "
                        "KVSIEVE_DEVICE, which Ray workers inherit); dtype auto then picks bf16 on a GPU that has it")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add) in VERBS.items():
        add(sub.add_parser(name, help=help_text))
    return parser
