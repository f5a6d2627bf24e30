"""``kvsieve serve``: an OpenAI-compatible server that compresses each request's cache at a certified point.

Flow: ``app`` (HTTP, OpenAI schemas) -> ``schemas`` (validation) -> ``prompt`` (messages -> context and
question token ids) -> ``points`` (the contract's point for the request's bucket, client overrides) ->
``scheduler`` (bounded queue, one model forward at a time) -> ``generation`` (the engine's attach and
greedy_decode) -> ``metrics`` (Prometheus text).
"""
