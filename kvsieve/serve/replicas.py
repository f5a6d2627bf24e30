"""``kvsieve serve --replicas N``: N servers on Ray Serve, each request sent to one by its document.

Three parts, on one machine or a Ray cluster ([scale-out.md](../../docs/scale-out.md)):

* :class:`Replica` (N of them, ``--threads`` CPUs each, default 1): one whole ``kvsieve serve``, its own model,
  scheduler, context cache and FastAPI app (``create_app``); it answers what the ingress hands it through that app
  (``asgi_call``), so every check, error, header and stream is the single server's, plus ``x-kvsieve-replica``, the
  replica's id.
* :class:`Ingress` (one, no CPU reserved): Ray Serve's HTTP proxy hands it every request; it reads the body (at most
  ``--max-body-mb``), takes the request's :func:`~kvsieve.serve.routing.context_key` and calls a replica with it.
* :class:`ContextRouter`: the replicas' request router, Ray Serve's extension point for choosing a replica. A request
  with a key goes to the key's replica by rendezvous hashing (:func:`~kvsieve.serve.routing.rank`), and waits for it
  rather than going elsewhere; one without (``--routing random``, a GET, a short or invalid body) to a replica drawn
  uniformly at random.

Why not Ray's own affinity: ``serve.multiplexed`` routes a model id to the replicas that have loaded it, but a new id
goes wherever load sends it and the replicas report what they hold asynchronously, so the first questions about a new
document can land on two replicas; ``PrefixCacheAffinityRouter`` (``ray.serve.llm``) matches prompt text but gives way
to load. A hash fixes a document's replica before its first request, with no state to keep.

Ray is imported here and nowhere else in the server: ``kvsieve serve`` without ``--replicas`` never imports this
module (the CLI picks it).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
from dataclasses import dataclass

import torch
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvsieve.bundled import canonical_name
from kvsieve.distributed.cluster import connect
from kvsieve.models import load
from kvsieve.serve import asgi_call
from kvsieve.serve.app import create_app
from kvsieve.serve.asgi_call import HttpRequest
from kvsieve.serve.command import checked_points, state_from_args
from kvsieve.serve.errors import error_body
from kvsieve.serve.routing import ROUTINGS, context_key, rank

__all__ = ["APP", "ContextRouter", "Ingress", "Replica", "ReplicaSettings", "application", "check", "run"]

APP = "kvsieve"  # the Ray Serve application's name
MAX_ONGOING = 4096  # requests Ray sends one replica at once: the replica's own scheduler queues and refuses (429)
REPLICA_HEADER = b"x-kvsieve-replica"
KEY_HEADER = b"x-kvsieve-context-key"  # the first 16 hex digits of the key the ingress routed on


@dataclass(frozen=True)
class ReplicaSettings:
    """What every replica is built from: ``kvsieve serve``'s parsed flags, its threads, the driver's device and
    working directory (relative contract and policy paths resolve against it, on every node)."""

    args: argparse.Namespace
    threads: int = 1
    device: str | None = None
    cwd: str = "."

    @classmethod
    def of(cls, args: argparse.Namespace) -> ReplicaSettings:
        return cls(args, getattr(args, "threads", None) or 1, os.environ.get("KVSIEVE_DEVICE"), os.getcwd())

    def actor_options(self) -> dict:
        env = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"), "OMP_NUM_THREADS": str(self.threads),
               "MKL_NUM_THREADS": str(self.threads)}
        if self.device:
            env["KVSIEVE_DEVICE"] = self.device
        options = {"num_cpus": self.threads, "runtime_env": {"env_vars": env}}
        if self.device and self.device.startswith("cuda"):
            options["num_gpus"] = 1
        return options


class Replica:
    """One whole server (see the module docstring); Ray Serve builds it in its own process."""

    def __init__(self, settings: ReplicaSettings) -> None:
        torch.set_num_threads(settings.threads)
        if os.path.isdir(settings.cwd):
            os.chdir(settings.cwd)
        args = settings.args
        points = checked_points(args)
        model, tokenizer = load(args.model, args.dtype)
        self.state = state_from_args(args, model, tokenizer, points)
        self.app = create_app(self.state)
        self.name = serve.get_replica_context().replica_id.unique_id

    async def answer(self, request: HttpRequest, route: str | None = None):
        """The app's answer to ``request``: a ``Head``, then the body's chunks (``route`` is the router's)."""
        async for part in asgi_call.call(self.app, request, [(REPLICA_HEADER, self.name.encode())]):
            yield part

    def __del__(self) -> None:
        # Ray Serve calls this once the replica's requests finished or its graceful shutdown timed out
        state = getattr(self, "state", None)
        if state is not None:
            state.draining = True
            state.scheduler.close(60.0)


class ContextRouter(RequestRouter):
    """The key's replica, or one drawn uniformly at random without a key: one replica each time Ray asks.

    Ray tries the replicas of each rank returned in turn, and passes over one that does not answer its queue-length
    probe within 0.1 s (more after each miss): a fallback rank would send a document's request to another replica
    whenever its own is slow to answer, as a busy CPU makes it. With one rank, Ray asks again, backing off, until the
    key's replica answers. A replica that dies leaves the candidates, and its keys go to their next in rank."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = None if pending_request is None else pending_request.kwargs.get("route")
        if key is None:
            return [[random.choice(candidate_replicas)]]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[rank(key, list(by_id))[0]]]]


async def _body(request: Request, limit: int) -> bytes:
    """The body, or its first ``limit + 1`` bytes (the replica's body limit then answers 413, as one server does);
    nothing of a body declared larger than ``limit``."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return b""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            break
    return bytes(body)


async def _rest(stream):
    finished = False
    try:
        async for chunk in stream:
            yield chunk
        finished = True
    finally:
        if not finished:
            stream.cancel()  # the client left: the replica's generator closes, its app sees http.disconnect


class Ingress:
    """The HTTP entry: each request's key, then its replica's answer, streamed through."""

    def __init__(self, replicas: DeploymentHandle, routing: str, max_body_bytes: int) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"routing {routing!r} is not one of {', '.join(ROUTINGS)}")
        self.replicas = replicas.options(stream=True)
        self.routing, self.max_body_bytes = routing, max_body_bytes

    async def __call__(self, request: Request) -> Response:
        path, root = request.scope["path"], request.scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        body = await _body(request, self.max_body_bytes)
        # parsing a large body takes time: off the event loop, so the streams this ingress carries go on
        key = (await run_in_threadpool(context_key, path, body) if self.routing == "context"
               and request.method == "POST" else None)
        call = HttpRequest(request.method, path, request.scope.get("query_string", b""),
                           list(request.scope["headers"]), body)
        stream = self.replicas.answer.remote(call, route=key)
        try:
            head = await stream.__anext__()
        except Exception as err:  # the replica died, or its app failed before answering
            return JSONResponse(error_body(f"no replica answered: {type(err).__name__}: {err}", "server_error"),
                                status_code=503)
        response = StreamingResponse(_rest(stream), status_code=head.status)
        response.raw_headers = [*head.headers, *([(KEY_HEADER, key[:16].encode())] if key else [])]
        return response


def application(settings: ReplicaSettings, replicas: int, routing: str = "context"):
    """The Ray Serve application: ``replicas`` :class:`Replica` behind one :class:`Ingress`."""
    args = settings.args
    drain = args.drain_timeout if args.drain_timeout is not None else 24 * 3600.0
    replica = serve.deployment(Replica, name="replica").options(
        num_replicas=replicas, ray_actor_options=settings.actor_options(), max_ongoing_requests=MAX_ONGOING,
        request_router_config=RequestRouterConfig(request_router_class=ContextRouter),
        graceful_shutdown_timeout_s=drain, max_constructor_retry_count=1)
    ingress = serve.deployment(Ingress, name="ingress").options(
        num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=MAX_ONGOING)
    return ingress.bind(replica.bind(settings), routing, int(args.max_body_mb * (1 << 20)))


def check(args: argparse.Namespace) -> ReplicaSettings:
    """Every check made before Ray starts (as a single server makes them before its model loads)."""
    if args.replicas < 1:
        raise ValueError(f"--replicas {args.replicas}: give a positive number of replicas")
    if args.routing not in ROUTINGS:
        raise ValueError(f"--routing {args.routing!r}: give one of {', '.join(ROUTINGS)}")
    checked_points(args)  # refuses a bad contract, point or flag before any replica loads
    return ReplicaSettings.of(args)


def _wait_for_a_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass


def run(args: argparse.Namespace) -> int:
    try:
        settings = check(args)
        connection = connect(args.ray_address)
    except (ValueError, FileNotFoundError) as err:
        print(f"kvsieve serve: error: {err}", file=sys.stderr)
        return 2
    deployed = False
    try:
        need, cpus = args.replicas * settings.threads, connection.cpus()
        if need > cpus:
            raise ValueError(f"--replicas {args.replicas} x --threads {settings.threads} need {need} CPUs; the Ray "
                             f"cluster has {cpus}")
        serve.start(http_options={"host": args.host, "port": args.port})
        deployed = True
        serve.run(application(settings, args.replicas, args.routing), name=APP, route_prefix="/")
        print(f"kvsieve serve: {canonical_name(args.model)}, {args.replicas} replicas on Ray ({settings.threads} "
              f"thread{'s' if settings.threads > 1 else ''} each, {args.routing} routing), "
              f"http://{args.host}:{args.port}/v1", flush=True)
        _wait_for_a_signal()
        return 0
    except (ValueError, RuntimeError) as err:  # too few CPUs; a replica that failed to start
        print(f"kvsieve serve: error: {err}", file=sys.stderr)
        return 2
    finally:
        if deployed:
            serve.delete(APP)  # waits for the replicas' graceful shutdown (--drain-timeout)
            if connection.owned and connection.address is None:
                serve.shutdown()  # the Ray instance this command started (a cluster's Serve stays for its other apps)
        connection.close()
