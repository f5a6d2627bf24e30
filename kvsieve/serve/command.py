"""``kvsieve serve``: arguments and the process (load the model once, serve until SIGTERM, drain, exit)."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import socket
import sys
from pathlib import Path

import torch
import uvicorn

from kvsieve.bundled import canonical_name
from kvsieve.models import context_length, load
from kvsieve.recall import Recall
from kvsieve.risk.contract import ContractFile
from kvsieve.risk.runtime import CertifiedPolicy
from kvsieve.serve.app import create_app
from kvsieve.serve.arguments import add_arguments
from kvsieve.serve.contexts import ContextCache
from kvsieve.serve.errors import quoted
from kvsieve.serve.points import PointSource
from kvsieve.serve.reading import DEFAULT_READ_TIMEOUT, head_deadline_protocol
from kvsieve.serve.scheduler import DEFAULT_PREFILL_CHUNK, Draining, Scheduler
from kvsieve.serve.server_metrics import Metrics
from kvsieve.serve.state import ServerState

__all__ = ["add_arguments", "run", "point_source", "build_state", "checked_points", "parse_budget", "free_memory",
           "state_from_args", "total_memory", "serve"]


def point_source(model: str, contract: str | None = None, policy: str | None = None, ratio: float | None = None,
                 question_aware: bool = False, allow_override: bool = False, evict_every: int = 0,
                 recall: str | None = None) -> PointSource:
    """The server's points, every check done before the model is loaded; ``evict_every`` N > 0 makes a plain
    ``--policy`` spec the decode-time point ``SPEC@decodeNeN`` (a label may carry its own mode: ``SPEC@decode64e32``;
    ``serve/decode_prefill.py``)."""
    if contract and policy:
        raise ValueError("give --contract or --policy/--ratio, not both")
    if policy is None and (ratio is not None or question_aware or recall is not None):
        raise ValueError("--ratio, --question-aware and --recall go with --policy (a contract's points carry their "
                         "own recall)")
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
    setting = None if recall is None else Recall.parse_setting(recall)
    return PointSource(None, policy, ratio or 0.0, question_aware, allow_override, evict_every, setting)


def _meminfo(field: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _device(model):
    return next(model.parameters()).device if model is not None else torch.device("cpu")


def free_memory(model) -> int:
    """Bytes free where the model's cache lives: the GPU's free memory, or the host's available memory."""
    device = _device(model)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    found = _meminfo("MemAvailable")
    return found if found is not None else int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def total_memory(model=None) -> int:
    """Bytes of memory where the model's cache lives (the GPU's, or the host's): no budget can be larger."""
    device = _device(model)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    found = _meminfo("MemTotal")
    return found if found is not None else int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


_UNITS = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_BUDGET = re.compile(r"(?P<number>[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)(?P<unit>[a-z%]*)")
BUDGET_FORMS = "bytes with a unit (195035136B, 512KiB, 186MiB, 2GiB, 1TiB) or a share of free memory (50%)"


def parse_budget(text: str | int, model=None, name: str = "--kv-budget", minimum: int = 1) -> int:
    """``--kv-budget``: bytes with an explicit unit (``B``, ``KiB``, ``MiB``, ``GiB``, ``TiB``), or ``P%`` of the free
    memory where the model's cache lives once it is loaded; a Python int is bytes. A number without a unit is
    refused (is 195035136 bytes or GiB?), as are non-finite values, budgets below ``minimum`` and budgets above the
    machine's memory; errors name the option ``name``."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        raw = str(text).strip().lower().replace(" ", "")
        match = _BUDGET.fullmatch(raw)
        if match is None:
            why = "is not a finite number" if raw.lstrip("+-").startswith(("inf", "nan")) else "is not a budget"
            raise ValueError(f"{name} {quoted(str(text))} {why}: give {BUDGET_FORMS}")
        number, unit = float(match["number"]), match["unit"]
        if not math.isfinite(number):
            raise ValueError(f"{name} {quoted(str(text))} is not a finite number: give {BUDGET_FORMS}")
        if unit == "":
            raise ValueError(f"{name} {quoted(str(text))} has no unit: give {BUDGET_FORMS}")
        if unit == "%":
            if not 0 < number <= 100:
                raise ValueError(f"{name} {quoted(str(text))}: a share of free memory is in (0, 100]%")
            if model is None:
                raise ValueError(f"{name} {quoted(str(text))}: a share of free memory needs the loaded model")
            value = int(number / 100 * free_memory(model))
        elif unit in _UNITS:
            value = int(number * _UNITS[unit])
        else:
            raise ValueError(f"{name} {quoted(str(text))} has an unknown unit {unit!r}: give {BUDGET_FORMS}")
    if value < minimum:
        raise ValueError(f"{name} {quoted(str(text))} is {value} bytes: give at least {minimum} ({BUDGET_FORMS})")
    memory = total_memory(model)
    if value > memory:
        where = "this GPU's memory" if _device(model).type == "cuda" else "this machine's memory"
        raise ValueError(f"{name} {quoted(str(text))} is {value} bytes, more than {where} ({memory} bytes, "
                         f"{memory / 2**30:.1f} GiB): give {BUDGET_FORMS}")
    return value


def build_state(model, tokenizer, model_name: str, points: PointSource, max_queue: int = 16,
                context: int | None = None, max_tokens_limit: int = 2048, default_max_tokens: int = 256,
                kv_budget: str | int = "50%", max_body_bytes: int = 4 << 20,
                prefill_chunk: int = DEFAULT_PREFILL_CHUNK, cold_budget: str | int | None = None,
                context_scope: str = "shared", read_timeout: float = DEFAULT_READ_TIMEOUT) -> ServerState:
    """The server's state: points model-checked, a scheduler admitting requests against ``kv_budget``;
    ``cold_budget`` (bytes, or a budget's text): keep compressed contexts for later questions, their cold tiers in
    that many bytes (None: no context cache), reused by every client or only within one API key (``context_scope``)."""
    context = context or context_length(model_name) or int(getattr(model.config, "max_position_embeddings", 2048))
    points.bind(model, model_name)  # every point model-checked once (a program's surrogate bound), before serving
    metrics = Metrics()
    contexts = None if cold_budget is None else ContextCache(parse_budget(cold_budget, model, "--cold-budget", 0),
                                                             metrics)
    scheduler = Scheduler(model, tokenizer, parse_budget(kv_budget, model), max_queue, prefill_chunk, metrics,
                          contexts)
    return ServerState(model, tokenizer, model_name, points, scheduler, context, max_tokens_limit,
                       default_max_tokens, max_body_bytes=max_body_bytes, metrics=metrics, context_scope=context_scope,
                       read_timeout=read_timeout)


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, with the drain of ``kvsieve serve``: on SIGTERM new requests get 503 ``draining``; requests
    in flight finish, up to ``drain_timeout`` seconds; then the scheduler fails the rest with 503 ``draining`` and a
    Retry-After (uvicorn itself, a few seconds later, would cancel them and answer a bare 500)."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float | None) -> None:
        super().__init__(config)
        self.kvsieve_state, self.drain_timeout = state, drain_timeout

    async def shutdown(self, sockets=None) -> None:
        state = self.kvsieve_state
        state.draining = True
        timer = None
        if self.drain_timeout is not None:
            err = Draining(f"the server is shutting down and its --drain-timeout ({self.drain_timeout:g} s) passed "
                           "before this request finished")
            timer = asyncio.get_running_loop().call_later(self.drain_timeout, state.scheduler.abort, err)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()


DRAIN_GRACE = 10.0  # seconds after the drain timeout the 503s have to be written before uvicorn cancels them


def serve(state: ServerState, host: str = "127.0.0.1", port: int = 8000, sock: socket.socket | None = None,
          log_level: str = "warning", drain_timeout: float | None = 120.0) -> uvicorn.Server:
    """A uvicorn server for ``state`` (call ``.run()``; from the main thread SIGTERM/SIGINT drain it)."""
    if drain_timeout is not None and not (math.isfinite(drain_timeout) and drain_timeout >= 0):
        raise ValueError(f"--drain-timeout must be a finite number of seconds >= 0, got {drain_timeout!r}")
    # h11 with a deadline on each request's head (the body's is the app's): uvicorn itself bounds neither
    config = uvicorn.Config(create_app(state), host=host, port=port, log_level=log_level, lifespan="on",
                            http=head_deadline_protocol(state.read_timeout),
                            timeout_graceful_shutdown=None if drain_timeout is None else drain_timeout + DRAIN_GRACE)
    server = _DrainingServer(config, state, drain_timeout)
    server.kvsieve_socket = sock
    return server


def checked_points(args: argparse.Namespace) -> PointSource:
    """The server's points, and every check of ``kvsieve serve``'s flags that needs no model: made before the model
    loads (and before Ray starts a replica); raises ValueError or FileNotFoundError naming the bad flag."""
    points = point_source(args.model, args.contract, args.policy, args.ratio, args.question_aware,
                          args.allow_override, args.evict_every, args.recall)
    if not str(args.kv_budget).strip().endswith("%"):
        parse_budget(args.kv_budget)  # a budget in bytes is checked before the model loads
    if args.context_cache and not str(args.cold_budget).strip().endswith("%"):
        parse_budget(args.cold_budget, None, "--cold-budget", 0)
    if args.drain_timeout is not None and not (math.isfinite(args.drain_timeout) and args.drain_timeout >= 0):
        raise ValueError(f"--drain-timeout must be a finite number of seconds >= 0, got {args.drain_timeout!r}")
    if not (math.isfinite(args.read_timeout) and args.read_timeout > 0):
        raise ValueError(f"--read-timeout must be a finite number of seconds > 0, got {args.read_timeout!r}")
    if args.prefill_chunk < 1:
        raise ValueError(f"--prefill-chunk must be a positive number of tokens, got {args.prefill_chunk}")
    return points


def state_from_args(args: argparse.Namespace, model, tokenizer, points: PointSource) -> ServerState:
    """``build_state`` with ``kvsieve serve``'s flags: one server's, or one replica's."""
    return build_state(model, tokenizer, canonical_name(args.model), points, args.max_queue, None,
                       args.max_tokens_limit, args.default_max_tokens, args.kv_budget,
                       int(args.max_body_mb * (1 << 20)), args.prefill_chunk,
                       args.cold_budget if args.context_cache else None, args.context_scope,
                       read_timeout=args.read_timeout)


def run(args) -> int:
    try:
        points = checked_points(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"kvsieve serve: error: {err}", file=sys.stderr)
        return 2
    name = canonical_name(args.model)
    model, tokenizer = load(args.model, args.dtype)  # once: every request shares it
    try:
        state = state_from_args(args, model, tokenizer, points)
    except ValueError as err:  # a point that cannot run on this model, a budget that cannot be read
        print(f"kvsieve serve: error: {err}", file=sys.stderr)
        return 2
    try:
        server = serve(state, args.host, args.port, log_level=args.log_level, drain_timeout=args.drain_timeout)
    except ValueError as err:
        print(f"kvsieve serve: error: {err}", file=sys.stderr)
        return 2
    print(f"kvsieve serve: {name}, points: {points.kind}"
          + (f" ({args.contract})" if args.contract else f" ({args.policy}@{args.ratio:g}, uncertified)"
             if args.policy else " (full KV)")
          + f", KV budget {state.scheduler.budget} bytes ({state.scheduler.budget / (1 << 20):.1f} MiB), prefill chunk "
            f"{state.scheduler.prefill_chunk} tokens, http://{args.host}:{args.port}/v1", flush=True)
    server.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvsieve serve", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.replicas:
        parser.error("--replicas runs through the kvsieve command (kvsieve serve --replicas N); this entry point "
                     "serves one process")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
