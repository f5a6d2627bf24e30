"""``kvsieve serve``: an OpenAI-compatible server that compresses each request's cache at a certified point.

Flow: ``app`` (HTTP, OpenAI schemas, body limit) -> ``schemas`` (validation) -> ``prompt`` (messages -> context
and question token ids) -> ``points`` (the request's point among those built at start-up, client choices) ->
``scheduler`` (continuous batching by KV bytes in steps: admission against a byte budget, at most one prefill chunk,
one batched decode step of every running request) -> ``generation`` (each request's prefill, read in chunks under its
own ``attach`` and compressed at its point) -> ``server_metrics`` (Prometheus text).
"""
