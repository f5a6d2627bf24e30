"""``kvsieve serve``'s flags, apart from the server so ``kvsieve --help`` does not import it."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="bundled model name or alias, or a local HF folder")
    parser.add_argument("--contract", help="contract JSON from kvsieve certify: its point per request bucket")
    parser.add_argument("--policy", help="an uncertified fixed policy spec instead of a contract (needs --ratio)")
    parser.add_argument("--ratio", type=float, help="compression ratio in [0, 1) with --policy")
    parser.add_argument("--question-aware", action="store_true", help="with --policy: keep the question out of it")
    parser.add_argument("--evict-every", type=int, default=0,
                        help="with --policy SPEC: serve the decode-time point SPEC@decodeNeN, evicting every N tokens "
                             "as kvsieve eval --mode decode does (the prompt read N tokens at a time, evicted after "
                             "each chunk; each row evicted every N generated tokens, held at its budgets plus N "
                             "entries a head). A label carries its own mode instead (--policy 'tova@decode64e32'), as "
                             "a contract's points do. 0 (default): the point as its spec says")
    parser.add_argument("--recall", help="with --policy: two tiers, what the policy evicts kept cold and each "
                             "question recalling what it attends to most, within the ratio's bytes: a fraction "
                             "(0.025) or recall(fraction=0.025, chunk=32, pool='span', sketch=..., cold=...); such a "
                             "point does not evict while it decodes")
    parser.add_argument("--allow-override", action="store_true",
                        help="let clients ask for looser points than the contract's (kvsieve.policy / kvsieve.ratio)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--kv-budget", default="50%",
                        help="KV-cache bytes requests are admitted against, with a unit: B, KiB, MiB, GiB, TiB "
                             "(195035136B, 186MiB, 2GiB), or a share of the free memory after the model loads "
                             "(default 50%%); at most the machine's memory")
    parser.add_argument("--context-cache", action=argparse.BooleanOptionalAction, default=True,
                        help="keep each context a query-agnostic point compressed (and a full-KV one whole) for later "
                             "requests whose prompt begins with it: their prefill reads only the rest; stored contexts "
                             "count in --kv-budget and go least recently used first (default on)")
    parser.add_argument("--cold-budget", default="25%",
                        help="bytes the stored contexts' cold tiers (points with recall) may take, as --kv-budget is "
                             "given (2GiB, 25%%; 0B: such contexts are not kept); disk cold tiers count here too, "
                             "their files under $TMPDIR (default 25%%)")
    parser.add_argument("--context-scope", choices=("shared", "api-key"), default="shared",
                        help="reuse a stored context for every client with the same prefix, or only for requests "
                             "with the same API key (Authorization: Bearer), so no client can time another's "
                             "documents (default shared)")
    parser.add_argument("--prefill-chunk", type=int, default=512,
                        help="prompt tokens one scheduler step prefills at most, beside one decode step of every "
                             "running request: bounds the gap between two tokens of a stream (default 512)")
    parser.add_argument("--max-queue", type=int, default=16,
                        help="requests waiting for room in the KV budget before new ones get 429 (default 16)")
    parser.add_argument("--max-body-mb", type=float, default=4.0,
                        help="largest request body accepted, in MiB (default 4); larger ones get 413")
    parser.add_argument("--read-timeout", type=float, default=30.0,  # reading.DEFAULT_READ_TIMEOUT (no uvicorn here)
                        help="seconds a request's head, and then its body, may take to arrive; a slower one gets 408 "
                             "and its connection is closed, as is one that sends nothing (default 30)")
    parser.add_argument("--max-tokens-limit", type=int, default=2048, help="most tokens one request may generate")
    parser.add_argument("--default-max-tokens", type=int, default=256, help="when a request names no max_tokens")
    parser.add_argument("--dtype", default="auto", help="auto | bfloat16 | float32")
    parser.add_argument("--drain-timeout", type=float, default=120.0,
                        help="seconds SIGTERM waits for in-flight requests (default 120)")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--replicas", type=int, default=0,
                        help="N > 0: N servers on Ray Serve, each with its own model, scheduler and context cache, "
                             "--threads threads each (default 1), behind one HTTP entry at --host/--port "
                             "(pip install 'kvsieve[replicas]'; docs/scale-out.md); 0: one server in this process "
                             "(default)")
    parser.add_argument("--routing", choices=("context", "random"), default="context",
                        help="with --replicas: context sends the requests about one document (the text before the "
                             "first question) to one replica, where its compressed context is kept; random spreads "
                             "them (default context)")
    parser.add_argument("--ray-address", help="with --replicas: auto (the cluster this machine is a node of) or "
                             "HOST:PORT of a Ray head; default: a local Ray instance")
