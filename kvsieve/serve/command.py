"""``kvsieve serve``: arguments and the process (load the model once, serve until SIGTERM, drain, exit)."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

import torch
import uvicorn

from kvsieve.bundled import canonical_name
from kvsieve.models import context_length, load
from kvsieve.risk.contract import ContractFile
from kvsieve.risk.runtime import CertifiedPolicy
from kvsieve.serve.app import create_app
from kvsieve.serve.arguments import add_arguments
from kvsieve.serve.points import PointSource
from kvsieve.serve.scheduler import Scheduler
from kvsieve.serve.state import ServerState

__all__ = ["add_arguments", "run", "point_source", "build_state", "parse_budget", "free_memory", "serve"]


def point_source(model: str, contract: str | None = None, policy: str | None = None, ratio: float | None = None,
                 question_aware: bool = False, allow_override: bool = False) -> PointSource:
    """The server's points, every check done before the model is loaded."""
    if contract and policy:
        raise ValueError("give --contract or --policy/--ratio, not both")
    if policy is None and (ratio is not None or question_aware):
        raise ValueError("--ratio and --question-aware go with --policy")
    if policy is not None and ratio is None:
        raise ValueError("--policy needs --ratio (the fraction of the cache removed, in [0, 1))")
    if contract:
        # refuses a contract for another model, and a point whose file is missing or changed since certification
        certified = CertifiedPolicy(ContractFile.read(contract), model, where=f"contract {contract}")
        file = certified.contract
        if file.by == "length" and file.length_quantity != "context_tokens":
            raise ValueError(f"contract {contract} buckets lengths on the nominal length, but requests are routed on "
                             "their context tokens: recertify it with kvsieve certify")
        return PointSource(certified, allow_override=allow_override)
    return PointSource(None, policy, ratio or 0.0, question_aware, allow_override)


def free_memory(model) -> int:
    """Bytes free where the model's cache lives: the GPU's free memory, or the host's available memory."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


_UNITS = {"gib": 1 << 30, "g": 1 << 30, "mib": 1 << 20, "m": 1 << 20, "kib": 1 << 10, "b": 1}


def parse_budget(text: str | int, model=None) -> int:
    """``--kv-budget``: bytes (an int), ``N`` or ``NGiB`` / ``NMiB`` / ``NKiB``, or ``P%`` of free memory."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        raw = str(text).strip().lower().replace(" ", "")
        try:
            if raw.endswith("%"):
                share = float(raw[:-1]) / 100
                if not 0 < share <= 1:
                    raise ValueError
                if model is None:
                    raise ValueError("a share of free memory needs the model")
                value = int(share * free_memory(model))
            else:
                unit = next((u for u in _UNITS if raw.endswith(u) and raw[: -len(u)]), "gib")
                number = raw[: -len(unit)] if raw.endswith(unit) else raw
                value = int(float(number) * _UNITS[unit])
        except ValueError:
            raise ValueError(f"--kv-budget {text!r} is not a budget: give GiB (4, 4GiB), MiB (512MiB) or a share of "
                             "free memory (50%)") from None
    if value < 1:
        raise ValueError(f"--kv-budget {text!r} is not a positive number of bytes")
    return value


def build_state(model, tokenizer, model_name: str, points: PointSource, max_queue: int = 16,
                context: int | None = None, max_tokens_limit: int = 2048, default_max_tokens: int = 256,
                kv_budget: str | int = "50%", max_body_bytes: int = 4 << 20) -> ServerState:
    """The server's state: points model-checked, a scheduler admitting requests against ``kv_budget``."""
    context = context or context_length(model_name) or int(getattr(model.config, "max_position_embeddings", 2048))
    points.bind(model, model_name)  # every point model-checked once (a program's surrogate bound), before serving
    scheduler = Scheduler(model, tokenizer, parse_budget(kv_budget, model), max_queue)
    return ServerState(model, tokenizer, model_name, points, scheduler, context, max_tokens_limit,
                       default_max_tokens, max_body_bytes=max_body_bytes)


def serve(state: ServerState, host: str = "127.0.0.1", port: int = 8000, sock: socket.socket | None = None,
          log_level: str = "warning", drain_timeout: float | None = 120.0) -> uvicorn.Server:
    """A uvicorn server for ``state`` (call ``.run()``; from the main thread SIGTERM/SIGINT drain it)."""
    config = uvicorn.Config(create_app(state), host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=drain_timeout)
    server = uvicorn.Server(config)
    server.kvsieve_socket = sock
    return server


def run(args) -> int:
    try:
        points = point_source(args.model, args.contract, args.policy, args.ratio, args.question_aware,
                              args.allow_override)
        if not str(args.kv_budget).strip().endswith("%"):
            parse_budget(args.kv_budget)  # a budget in bytes is checked before the model loads
    except (ValueError, FileNotFoundError) as err:
        print(f"kvsieve serve: error: {err}", file=sys.stderr)
        return 2
    name = canonical_name(args.model)
    model, tokenizer = load(args.model, args.dtype)  # once: every request shares it
    try:
        state = build_state(model, tokenizer, name, points, args.max_queue, None, args.max_tokens_limit,
                            args.default_max_tokens, args.kv_budget, int(args.max_body_mb * (1 << 20)))
    except ValueError as err:  # a point that cannot run on this model, a budget that cannot be read
        print(f"kvsieve serve: error: {err}", file=sys.stderr)
        return 2
    server = serve(state, args.host, args.port, log_level=args.log_level, drain_timeout=args.drain_timeout)
    print(f"kvsieve serve: {name}, points: {points.kind}"
          + (f" ({args.contract})" if args.contract else f" ({args.policy}@{args.ratio:g}, uncertified)"
             if args.policy else " (full KV)")
          + f", KV budget {state.scheduler.budget / (1 << 30):.2f} GiB, http://{args.host}:{args.port}/v1", flush=True)
    server.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvsieve serve", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
