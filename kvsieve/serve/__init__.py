"""``kvsieve serve``: an OpenAI-compatible server that compresses each request's cache at a certified point.

Flow: ``app`` (HTTP, OpenAI schemas, body limit) -> ``schemas`` (validation) -> ``prompt`` (messages -> context
and question token ids) -> ``points`` (the request's point among those built at start-up, client choices) ->
``scheduler`` (continuous batching by KV bytes: admission against a byte budget, one batched decode step of
every running request) -> ``generation`` (each request's prefill under its own ``attach``) -> ``metrics``
(Prometheus text).
"""
