"""``kvsieve serve``: arguments and the process (load the model once, serve until SIGTERM, drain, exit)."""

from __future__ import annotations

import argparse
import socket
import sys

import uvicorn

from kvsieve.models import bundled, context_length, load
from kvsieve.risk.contract import ContractFile
from kvsieve.risk.runtime import CertifiedPolicy, canonical_model
from kvsieve.serve.app import create_app
from kvsieve.serve.arguments import add_arguments
from kvsieve.serve.points import PointSource
from kvsieve.serve.scheduler import Scheduler
from kvsieve.serve.state import ServerState

__all__ = ["add_arguments", "run", "point_source", "build_state", "serve"]


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
        certified = CertifiedPolicy(ContractFile.read(contract), model)  # refuses a contract for another model
        file = certified.contract
        if file.by == "length" and file.length_quantity != "context_tokens":
            raise ValueError(f"contract {contract} buckets lengths on the nominal length, but requests are routed on "
                             "their context tokens: recertify it with kvsieve certify")
        return PointSource(certified, allow_override=allow_override)
    return PointSource(None, policy, ratio or 0.0, question_aware, allow_override)


def build_state(model, tokenizer, model_name: str, points: PointSource, max_queue: int = 16,
                context: int | None = None, max_tokens_limit: int = 2048, default_max_tokens: int = 256) -> ServerState:
    context = context or context_length(model_name) or int(getattr(model.config, "max_position_embeddings", 2048))
    return ServerState(model, tokenizer, model_name, points, Scheduler(max_queue), context, max_tokens_limit,
                       default_max_tokens)


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
    except (ValueError, FileNotFoundError) as err:
        print(f"kvsieve serve: error: {err}", file=sys.stderr)
        return 2
    name = bundled(args.model).name if bundled(args.model) else canonical_model(args.model)
    model, tokenizer = load(args.model, args.dtype)  # once: every request shares it
    state = build_state(model, tokenizer, name, points, args.max_queue, None, args.max_tokens_limit,
                        args.default_max_tokens)
    server = serve(state, args.host, args.port, log_level=args.log_level, drain_timeout=args.drain_timeout)
    print(f"kvsieve serve: {name}, points: {points.kind}"
          + (f" ({args.contract})" if args.contract else f" ({args.policy}@{args.ratio:g}, uncertified)"
             if args.policy else " (full KV)")
          + f", http://{args.host}:{args.port}/v1", flush=True)
    server.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvsieve serve", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
