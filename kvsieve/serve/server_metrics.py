"""Counters and histograms for ``GET /metrics``, in the Prometheus text exposition format (version 0.0.4)."""

from __future__ import annotations

import threading
from bisect import bisect_left

__all__ = ["Metrics", "LATENCY_BUCKETS"]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    escaped = (f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
               for k, v in sorted(labels.items()))
    return "{" + ",".join(escaped) + "}"


def _number(value: int | float) -> str:
    """Integers exactly (byte counters pass 1e6, where ``:g`` would round them); floats at full precision."""
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        i = bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.n += 1


class Metrics:
    HELP = {
        "kvsieve_requests_total": ("counter", "Requests answered, by endpoint, HTTP status and kv-cache status."),
        "kvsieve_point_requests_total": ("counter", "Requests answered, by the point that ran (its spec and mode: "
                                                    "tova@decode64e32, knorm, full) and kv-cache status."),
        "kvsieve_prompt_tokens_total": ("counter", "Prompt tokens of answered requests."),
        "kvsieve_completion_tokens_total": ("counter", "Generated tokens."),
        "kvsieve_kv_bytes_full_total": ("counter", "KV-cache bytes the prompts would have held uncompressed."),
        "kvsieve_kv_bytes_kept_total": ("counter", "KV-cache bytes the prompts held after compression."),
        "kvsieve_kv_bytes_saved_total": ("counter", "KV-cache bytes compression freed."),
        "kvsieve_kv_bytes_cold_total": ("counter", "Bytes of evicted entries kept in the cold tier (points with "
                                                   "recall)."),
        "kvsieve_kv_bytes_moved_total": ("counter", "Bytes questions brought back from the cold tier."),
        "kvsieve_request_seconds": ("histogram", "Time from arrival to the last byte of the answer."),
        "kvsieve_time_to_first_token_seconds": ("histogram", "Time from arrival to the first generated token."),
        "kvsieve_inter_token_seconds": ("histogram", "Time between two successive generated tokens of a request."),
        "kvsieve_queue_seconds": ("histogram", "Time from arrival to admission (the KV budget had room)."),
        "kvsieve_policy_failures_total": ("counter", "Requests whose policy failed and were answered at full KV."),
        "kvsieve_context_cache_hits_total": ("counter", "Requests whose context began with a stored compressed "
                                                        "context (its prefill not paid again)."),
        "kvsieve_context_cache_misses_total": ("counter", "Query-agnostic requests that read their context whole."),
        "kvsieve_context_cache_evictions_total": ("counter", "Stored contexts evicted (least recently used first)."),
        "kvsieve_context_cache_refused_total": ("counter", "Contexts too large to store beside the running requests."),
        "kvsieve_context_cache_entries": ("gauge", "Compressed contexts stored now."),
        "kvsieve_context_cache_hot_bytes": ("gauge", "Hot-tier bytes of the stored contexts (in the KV budget)."),
        "kvsieve_context_cache_cold_bytes": ("gauge", "Cold-tier bytes of the stored contexts (in --cold-budget)."),
        "kvsieve_queue_waiting": ("gauge", "Requests waiting for room in the KV budget."),
        "kvsieve_requests_running": ("gauge", "Requests admitted (prefilling or in the decode batch)."),
        "kvsieve_kv_budget_bytes": ("gauge", "The KV-cache byte budget requests are admitted against."),
        "kvsieve_kv_admitted_bytes": ("gauge", "KV bytes charged to admitted requests now."),
        "kvsieve_kv_admitted_peak_bytes": ("gauge", "The most KV bytes ever charged at once."),
        "kvsieve_kv_allocated_peak_bytes": ("gauge", "The most KV bytes the decode batch and the prefills in progress "
                                                     "allocated at once (measured after each step)."),
    }

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, tuple], int | float] = {}
        self._histograms: dict[str, _Histogram] = {name: _Histogram(LATENCY_BUCKETS) for name, (kind, _) in
                                                   self.HELP.items() if kind == "histogram"}
        self.gauges: dict[str, int | float] = {}

    def inc(self, name: str, value: int | float = 1, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._counters[key] = self._counters.get(key, 0) + value

    def observe(self, name: str, seconds: float) -> None:
        with self._lock:
            self._histograms[name].observe(seconds)

    def value(self, name: str, **labels: str) -> float:
        return self._counters.get((name, tuple(sorted(labels.items()))), 0)

    def render(self) -> str:
        lines: list[str] = []
        with self._lock:
            for name, (kind, text) in self.HELP.items():
                lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
                if kind == "counter":
                    for (metric, labels), value in sorted(self._counters.items()):
                        if metric == name:
                            lines.append(f"{name}{_labels(dict(labels))} {_number(value)}")
                elif kind == "gauge":
                    lines.append(f"{name} {_number(self.gauges.get(name, 0))}")
                else:
                    hist, running = self._histograms[name], 0
                    for edge, count in zip(hist.buckets, hist.counts):
                        running += count
                        lines.append(f'{name}_bucket{{le="{edge:g}"}} {running}')
                    lines += [f'{name}_bucket{{le="+Inf"}} {hist.n}', f"{name}_sum {_number(hist.total)}",
                              f"{name}_count {hist.n}"]
        return "\n".join(lines) + "\n"
