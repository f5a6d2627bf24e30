"""Command line: kvsieve eval | report | pick | generate | certify | evolve | train | serve | demo.

Only light modules are imported at the top (argparse, the grid definition, the spec parser): torch
and transformers load after the arguments are parsed, so ``--help`` answers at once and the thread
settings below are in place before OpenMP starts.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
from pathlib import Path

from kvsieve.cli_arguments import build_parser
from kvsieve.config import load_config
from kvsieve.spec import split_specs

DEMO_PICK = "program:smollm2-pick"  # `kvsieve pick`'s SmolLM2 program, shipped by name
DEMO_KVZAP = "kvzap(checkpoint='smollm2-135m-instruct')"
DEMO = dict(  # the GridConfig of `kvsieve demo`: published baselines beside what kvsieve adds
    model="smollm2-135m-instruct",
    tasks=["niah_single_1", "niah_multikey_1", "vt"],
    lengths=[1024],
    policies=["full", "tova", "snapkv", "kvzip", DEMO_KVZAP, DEMO_PICK],
    qa_policies=["snapkv(window=32)"],  # the question-aware reference line, its window inside the question
    ratios=[0.5, 0.875],
    samples=4,
    store="results/demo/cells.sqlite",
)
# the demo's contract: at most 25% of requests more than 0 points below full KV, with 80% confidence
DEMO_CONTRACT = dict(alpha=0.25, delta=0.2, epsilon=0.0)


def _csv(text: str, kind=str, flag: str = "") -> list:
    """Comma-separated values of ``kind``; a bad item names the flag it was given to."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        try:
            out.append(kind(item))
        except ValueError:
            where = f"{flag} " if flag else ""
            raise ValueError(f"{where}{text!r}: {item!r} is not a{'n' if kind is int else ''} {kind.__name__}; "
                             f"expected comma-separated {kind.__name__}s") from None
    return out


def _grid(args):
    from kvsieve.harness.grid import GridConfig

    flags = {
        "model": args.model,
        "tasks": args.tasks and _csv(args.tasks),
        "lengths": args.lengths and _csv(args.lengths, int, "--lengths"),
        "policies": args.policies and split_specs(args.policies),
        "qa_policies": args.qa_policies and split_specs(args.qa_policies),
        "recalls": args.recalls and split_specs(args.recalls),
        "ratios": args.ratios and _csv(args.ratios, float, "--ratios"), "samples": args.samples, "seed": args.seed,
        "store": args.store, "data": args.data, "dtype": args.dtype, "mode": args.mode, "chunk_size": args.chunk_size,
        "evict_every": args.evict_every, "program_budget_s": args.program_budget,
    }
    if args.question_aware:
        flags["question_aware"] = True
    if args.per_cell:
        flags["shared"] = False
    return load_config(GridConfig, args.config, **flags)


def _run_grid(config, args):
    """``run_grid`` through the executor the flags name (the local one when none is named)."""
    from kvsieve.harness.run import make_grid_executor, run_grid

    executor = make_grid_executor(args.executor or "local", args.ray_address, args.workers)
    if args.executor != "ray":
        return run_grid(config)
    try:
        return run_grid(config, executor=executor)
    finally:
        executor.close()


def cmd_eval(args) -> int:
    config = _grid(args)
    _run_grid(config, args).close()
    # the run is done: its tables show a store extended on another machine, naming both, rather than fail
    _print_tables([config.store], config.model, mixed_machines=True)
    return 0


def _print_tables(stores: list[str], model: str | None, out: str | None = None, markdown: bool = False,
                  tasks: list[str] | None = None, mixed_machines: bool = False) -> None:
    from kvsieve.bundled import canonical_name
    from kvsieve.harness.report import report_text
    from kvsieve.harness.report_plots import write_plots
    from kvsieve.harness.store import read_stores

    filters = {k: v for k, v in (("model", model and canonical_name(model)), ("task", tasks)) if v}
    results, failures = read_stores(stores, **filters)
    if not results and not failures:
        print("the store holds no results" + (f" for model {model}" if model else ""))
        return
    print(report_text(results, markdown=markdown, allow_mixed_machines=mixed_machines,
                      failures=failures))  # one block per model; failed cells counted, never in a mean
    if out and results:
        print("\nplots: " + ", ".join(str(p) for p in write_plots(results, out)))


def _compare_pairs(texts: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for text in texts:
        pair = split_specs(text)  # specs may hold commas inside parentheses
        if len(pair) != 2:
            raise ValueError(f"--compare {text!r}: expected two policy specs A,B (e.g. kvzip,tova)")
        pairs.append((pair[0], pair[1]))
    return pairs


def cmd_report(args) -> int:
    if args.compare and not args.headline:
        raise ValueError("--compare needs --headline")
    tasks = _csv(args.tasks) if args.tasks else None
    if args.headline:
        from kvsieve.harness.headline import headline_report

        print(headline_report(args.store, args.model, _compare_pairs(args.compare), tasks,
                              resamples=args.resamples, allow_mixed_machines=args.mixed_machines))
        return 0
    _print_tables(args.store, args.model, args.out, args.markdown, tasks, args.mixed_machines)
    return 0


def cmd_pick(args) -> int:
    import json

    from kvsieve.evolve.pick import exploratory, format_pick, load_rule, pick, summary, write_pick

    rule = load_rule(args.config)
    models = [args.model] if args.model else list(rule.databases)
    picks = [pick(rule, model) for model in models]
    if args.json:
        print(json.dumps([summary(p) for p in picks], indent=1))
    else:
        print("\n".join(format_pick(p) for p in picks))
    for p in picks:
        if args.out:
            print(f"wrote {write_pick(p, args.out, args.config)}")
        if args.store:
            tried = exploratory(args.store, p.model)
            print(f"{args.store}, {p.model}: {len(tried['found_or_learned'])} found or learned policies and "
                  f"{len(tried['baselines'])} baselines scored on its requests (exploratory beside the pick): "
                  + ", ".join(tried["found_or_learned"]))
    return 0


def cmd_generate(args) -> int:
    from kvsieve.harness.grid import GridConfig
    from kvsieve.harness.validate import validate
    from kvsieve.models import load
    from kvsieve.policies.label import FULL_CACHE
    from kvsieve.tasks import write_jsonl
    from kvsieve.tasks.load import load_samples

    config = GridConfig(model=args.model, tasks=_csv(args.tasks), lengths=_csv(args.lengths, int, "--lengths"),
                        samples=args.samples, seed=args.seed, policies=[FULL_CACHE])
    validate(config)
    _, tokenizer = load(config.model)
    count = write_jsonl(load_samples(config.sample_spec(), tokenizer), args.out)
    print(f"wrote {count} samples to {args.out}")
    return 0


def cmd_certify(args) -> int:
    from kvsieve.harness.store import ResultsStore
    from kvsieve.policies.label import FULL_CACHE
    from kvsieve.risk import Contract, certify_buckets, loss_table
    from kvsieve.risk.contract import request_context_tokens
    from kvsieve.risk.losses import candidates_for

    contract = Contract(alpha=args.alpha, delta=args.delta, epsilon=args.epsilon, loss=args.loss,
                        correction=args.correction)  # checks alpha, delta, epsilon before any work
    ratios = _csv(args.ratios, float, "--ratios")
    # every candidate a checked Point (ratio, label, question-awareness) before any work
    candidates = candidates_for(split_specs(args.policies), ratios, args.question_aware)
    compressing = list(dict.fromkeys(c.stored for c in candidates))
    tasks = _csv(args.tasks) if args.tasks else None
    lengths = _csv(args.lengths, int, "--lengths") if args.lengths else None
    edges = _csv(args.length_edges, int, "--length-edges") if args.length_edges else None
    if args.run:
        if not tasks or not lengths:
            raise ValueError("--run needs --tasks and --lengths to know which calibration cells to evaluate")
        from kvsieve.harness.grid import GridConfig
        from kvsieve.policies.label import DECODE

        common = dict(model=args.model, tasks=tasks, lengths=lengths, ratios=ratios, samples=args.samples,
                      seed=args.seed, store=args.store)
        grids = []
        prefill = [c for c in candidates if not c.mode.is_decode]
        if prefill:
            # a candidate with recall runs as its policy with the grid's recalls (stored SPEC@recall(...) again)
            plain = list(dict.fromkeys(c.spec for c in prefill))
            recalls = list(dict.fromkeys(c.mode.recall for c in prefill if c.mode.recall))
            grid = GridConfig(policies=[FULL_CACHE, *plain], question_aware=args.question_aware, recalls=recalls,
                              **common)
            if args.question_aware:  # only the question-aware variants are candidates
                grid.policies, grid.qa_policies = [FULL_CACHE], compressing
            grids.append(grid)
        # a decode-time candidate (SPEC@decodeNeE) runs in a grid of its mode, beside full KV read the same way
        for mode in dict.fromkeys(c.mode for c in candidates if c.mode.is_decode):
            specs = list(dict.fromkeys(c.spec for c in candidates if c.mode == mode))
            grids.append(GridConfig(policies=[FULL_CACHE, *specs], mode=DECODE, chunk_size=mode.chunk_size,
                                    evict_every=mode.evict_every, **common))
        for grid in grids:
            _run_grid(grid, args).close()
    if not Path(args.store).is_file():
        raise ValueError(f"results store {args.store} does not exist (add --run to evaluate the calibration cells)")
    with ResultsStore(args.store) as store:
        table = loss_table(store, args.model, candidates, contract.epsilon, contract.loss, tasks, lengths)
        # length buckets route on a request's context tokens, so they calibrate on them too
        tokens = request_context_tokens(store, table.model, table.requests) if args.by == "length" else None
    if table.left_out:
        print(table.left_out_summary())
    result = certify_buckets(table, contract, table.model, args.by, edges, context_tokens=tokens)
    result.source = {"store": str(args.store), "policies": compressing, "ratios": ratios, "tasks": tasks,
                     "lengths": lengths, "question_aware": args.question_aware}
    path = result.write(args.out)
    print(f"contract: alpha={contract.alpha} delta={contract.delta} epsilon={contract.epsilon} loss={contract.loss} "
          f"correction={contract.correction}, by {result.by}")
    for name, cert in result.buckets.items():
        print(f"\n[{name}] n={cert.n}, tested at delta={cert.delta:.4g}")
        for line in cert.table_lines():
            print("  " + line)
        print(f"  -> {cert.verdict()}")
    print(f"\nwrote {path}")
    return 0


def cmd_evolve(args) -> int:
    from kvsieve.evolve.evolution import run_evolution
    from kvsieve.evolve.evolve_config import load_config
    from kvsieve.evolve.sandbox import SandboxUnavailable
    from kvsieve.models import check_length
    from kvsieve.policies.label import FULL_CACHE
    from kvsieve.policies.program import program_spec

    config = load_config(args.config, model=args.model, candidates=args.candidates, seed=args.seed,
                         strategy=args.strategy, mutator=args.llm, llm_base_url=args.llm_base_url,
                         llm_model=args.llm_model, llm_api_key_env=args.llm_api_key_env, db=args.db, out=args.out,
                         dev_cache=args.dev_cache,
                         time_budget_s=args.time_budget, executor=args.executor, ray_address=args.ray_address,
                         workers=args.workers, sandbox=args.sandbox)
    check_length(config.model, config.length)
    try:
        result = run_evolution(config)
    except SandboxUnavailable as err:  # the machine cannot run the sandbox: not a candidate's fault
        raise ValueError(f"the sandbox cannot run here: {err}") from None
    if result.best is not None:
        print(f"best program #{result.best.id}: dev score {result.best.score:.1f}, held-out "
              f"{result.heldout.get(result.best.id, float('nan')):.1f} -> {result.best_path}")
        print(f"evaluate it: kvsieve eval --model {config.model} "
              f"--policies \"{FULL_CACHE},{program_spec(result.best_path, config.surrogate)}\" ...")
    print(f"report: {result.report}")
    return 0


def cmd_train(args) -> int:
    import dataclasses

    from kvsieve.learn.train import train
    from kvsieve.learn.train_config import load_config
    from kvsieve.models import check_length
    from kvsieve.policies.label import FULL_CACHE

    top_k = args.teacher_top_k
    config = load_config(args.config, model=args.model, tasks=args.tasks and _csv(args.tasks), length=args.length,
                         samples=args.samples, seed=args.seed, steps=args.steps, lr=args.lr,
                         ratios=args.ratios and _csv(args.ratios, float, "--ratios"), mode=args.mode,
                         chunk_size=args.chunk_size,
                         window=args.window, rollouts=args.rollouts, entropy_coef=args.entropy_coef,
                         grad_clip=args.grad_clip, baseline=args.baseline, out=args.out, data=args.data,
                         dtype=args.dtype, save_every=args.save_every, teacher_top_k=top_k or None,
                         objective=args.objective, init=args.init, hidden=args.hidden,
                         network=args.network, temperature=args.temperature, kvzap_inputs=args.kvzap_inputs)
    if top_k == 0:  # the whole vocabulary
        config = dataclasses.replace(config, teacher_top_k=None)
    check_length(config.model, config.length)
    if (args.ray_address or args.workers) and not args.ray:
        raise ValueError("--ray-address and --workers go with --ray")
    remote = None
    if args.ray:
        from kvsieve.learn.ray_rollouts import RayRollouts

        remote = RayRollouts(address=args.ray_address, workers=args.workers)
    try:
        result = train(config) if remote is None else train(config, remote=remote)
    finally:
        if remote is not None:
            remote.close()
    last = result.history[-1] if result.history else None
    if last is not None and "reward" in last:
        print(f"step {result.step}: reward {last['reward']:.5f} (minus KL per token), entropy {last['entropy']:.3f}")
    print(f"policy: {result.policy}\nlog: {result.log}\ncurve: {result.curve}")
    print(f"evaluate it: kvsieve eval --model {config.model} --policies "
          f"\"{FULL_CACHE},{config.policy_family}(checkpoint='{result.policy}')\"")
    return 0


def cmd_serve(args) -> int:
    if args.replicas:  # on Ray Serve: only then is Ray imported
        from kvsieve.serve.replicas import run
    else:
        from kvsieve.serve.command import run

    return run(args)


def cmd_demo(args) -> int:
    from kvsieve.harness.grid import GridConfig
    from kvsieve.harness.headline import headline_report
    from kvsieve.harness.run import run_grid

    config = GridConfig(**DEMO)
    run_grid(config).close()
    print(headline_report([config.store], config.model, [(DEMO_PICK, "kvzip"), (DEMO_PICK, "tova")], resamples=2000))
    contract = Path(config.store).parent / "contract.json"
    certify = argparse.Namespace(
        store=config.store, model=config.model, policies=",".join([DEMO_KVZAP, DEMO_PICK, "kvzip"]),
        ratios=",".join(str(r) for r in config.ratios), loss="binary", correction="bonferroni", by="none",
        length_edges=None, tasks=None, lengths=None, question_aware=False, run=False, out=str(contract),
        **DEMO_CONTRACT)
    print("\n## The certified point\n")
    cmd_certify(certify)
    print(f"\nServe it (every request compressed at the certified point, or full KV where none is):\n"
          f"  kvsieve serve --model {config.model} --contract {contract} --port 8765")
    return 0


def _set_threads(threads: int | None) -> None:
    """OpenMP settings that must precede the first ``import torch``.

    On a 2-core machine with anything else running, OpenMP's default active wait made one 1024-token
    SmolLM2 cell take 19.1 s instead of 3.8 s (issue 17; ``benchmarks/threads.py`` measures it): a
    thread that waits spins on a core another process needs. So unless the user set it, the wait is
    passive. ``--threads N`` sets the thread count (default: torch's, one per core).
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads {threads}: give a positive number of threads")
        os.environ["OMP_NUM_THREADS"] = str(threads)
        os.environ["MKL_NUM_THREADS"] = str(threads)


COMMANDS = {"eval": cmd_eval, "report": cmd_report, "pick": cmd_pick, "generate": cmd_generate,
            "certify": cmd_certify, "evolve": cmd_evolve, "train": cmd_train, "serve": cmd_serve, "demo": cmd_demo}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _set_threads(args.threads)
        if args.device is not None:
            os.environ["KVSIEVE_DEVICE"] = args.device
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)  # OMP_NUM_THREADS is read only if torch was not loaded yet
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print(f"\nkvsieve {args.command}: interrupted; everything finished before is saved (rerun the same "
              "command to resume)", file=sys.stderr)
        return 130
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"kvsieve {args.command}: error: {err}", file=sys.stderr)
        return 2
    except (IsADirectoryError, NotADirectoryError, PermissionError) as err:
        print(f"kvsieve {args.command}: error: {err.strerror}: {err.filename}", file=sys.stderr)
        return 2
    except sqlite3.DatabaseError as err:
        print(f"kvsieve {args.command}: error: not a kvsieve SQLite file, or a damaged one ({err})", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
