"""``kvsieve serve``: an OpenAI-compatible server that compresses each request's cache at a certified point.

Flow, cut as vLLM and SGLang cut serving (decide / run / detokenize): ``app`` (the routes) -> ``schemas``
(validation; ``body_limit``, the ASGI middleware, before them) -> ``chat_prompt`` (messages -> context and question
token ids) -> ``points`` (``PointSource.decide``: the one decision of the point a request runs, among those built at
start-up) -> ``call`` (one request's life: submitted, answered whole or streamed as server-sent events) ->
``scheduler`` (continuous batching by KV bytes in steps: admission against a byte budget, at most one prefill chunk,
one batched decode step of every running request) -> ``generation`` (each request's prefill, read in chunks under
its own ``attach`` and compressed at its point) and ``decode_eviction`` (a compressing row held at its cap while it
decodes) -> ``text_stream`` (detokenizing, stop strings) -> ``usage`` (what a reply reports about its cache) and
``server_metrics`` (Prometheus text).

``replicas`` (``kvsieve serve --replicas N``, the one module that imports Ray) runs N such servers on Ray Serve:
``routing`` picks a request's replica by its document, ``asgi_call`` runs it through that replica's app.
"""
