"""What a reply reports about its cache: ``usage.kv_cache`` and the ``x-kvsieve-*`` headers.

Every answer carries the policy and ratio it ran, whether that point is the contract's certified one, a fallback to
full KV (and why), or the client's choice, the cache bytes the prompt would have held and held (the hot tier), the
cold tier's bytes and what the question recalled from it (points with recall), the tokens kept per layer, and
whether its context came from the server's context cache (``context_cache``: hit, or miss; None when not kept).
"""

from __future__ import annotations

from kvsieve.serve.generation import CacheInfo
from kvsieve.serve.points import ChosenPoint
from kvsieve.serve.state import ServerState

__all__ = ["kv_cache_usage", "kv_headers"]


def kv_cache_usage(state: ServerState, chosen: ChosenPoint, info: CacheInfo) -> dict:
    chosen = info.chosen or chosen  # the point that ran: full KV when the request's policy failed
    setting = chosen.setting  # full KV's when it fell back
    contract = state.points.certified.contract.contract if state.points.certified else None
    return {
        "policy": setting.spec,
        "ratio": setting.ratio,
        "point": str(setting),  # spec, mode and ratio: tova@decode64e32@0.5
        "evict_every": chosen.evict_every,  # generated tokens between the row's evictions (0: it never evicts then)
        "question_aware": setting.question_aware,
        "status": chosen.status,
        "certified": chosen.certified,
        "bucket": chosen.point.bucket,
        "reason": chosen.point.reason,
        "contract": None if contract is None else {"alpha": contract.alpha, "delta": contract.delta,
                                                   "epsilon": contract.epsilon, "loss": contract.loss},
        "context_tokens": info.context_tokens,
        "bytes_full": info.bytes_full,
        "bytes_kept": info.bytes_kept,
        "bytes_saved": info.bytes_full - info.bytes_kept,
        "kept_fraction": round(info.bytes_kept / max(1, info.bytes_full), 6),
        "kept_tokens_per_layer": info.kept_tokens,
        "recall": None if setting.mode.recall is None else setting.mode.recall.text,
        "bytes_cold": info.cold_bytes,
        "bytes_moved": info.moved_bytes,
        "context_cache": info.context_cache,
    }


def _header(value: object, limit: int = 256) -> str:
    """A header value: printable ASCII only (a CR, LF or NUL would end the header or the connection; non-ASCII is
    not latin-1 safe), cut to ``limit``. Every value here is the server's own (bucket names come from the contract,
    never the client's text); this is the second line of defence."""
    text = "".join(c if " " <= c <= "~" else "?" for c in str(value)[:limit])
    return text


def kv_headers(kv: dict) -> dict[str, str]:
    return {"x-kvsieve-policy": _header(kv["policy"]), "x-kvsieve-ratio": f"{kv['ratio']:g}",
            "x-kvsieve-status": kv["status"], "x-kvsieve-bucket": _header(kv["bucket"]),
            "x-kvsieve-point": _header(kv["point"]), "x-kvsieve-evict-every": str(kv["evict_every"]),
            "x-kvsieve-bytes-full": str(kv["bytes_full"]),
            "x-kvsieve-bytes-kept": str(kv["bytes_kept"]), "x-kvsieve-bytes-cold": str(kv["bytes_cold"]),
            "x-kvsieve-bytes-moved": str(kv["bytes_moved"]), "x-kvsieve-context-cache": str(kv["context_cache"]),
            "x-kvsieve-kept-tokens": ",".join(str(t) for t in kv["kept_tokens_per_layer"])}
