"""Which replica a request goes to: the digest of its document, and the replica that digest picks.

A replica keeps a document's context compressed for later questions (``serve/contexts.py``), matched as a prefix of
a request's context. Requests about one document should therefore reach one replica; :func:`context_key` is what they
share, read from the request body without a tokenizer:

* a chat request: the system and developer messages before its first user turn, and that turn's text up to its last
  newline (where ``chat_prompt`` cuts a lone user message into context and question). Later turns of the same
  conversation share it: their context begins with the first turn's;
* a completion request: its prompt up to its last newline (where ``completion_prompt`` cuts it).

A document shorter than :data:`MIN_DOCUMENT_CHARS` has no key: there is little to keep, and every chat without a
document would otherwise share one key and one replica. A body that does not parse has none either (the replica it
reaches answers the error).

:func:`rank` orders replicas for a key by rendezvous (highest random weight) hashing: each replica scores
``sha256(key, replica id)`` and the highest wins, so a key keeps its replica while the replicas stay, and when one
goes or comes only the keys it won or wins move.
"""

from __future__ import annotations

import hashlib
import json

from kvsieve.serve.errors import APIError
from kvsieve.serve.schemas import ChatCompletionRequest, CompletionRequest, parse_body

__all__ = ["MIN_DOCUMENT_CHARS", "ROUTINGS", "context_key", "document_of", "rank"]

MIN_DOCUMENT_CHARS = 256  # about 64 tokens of English: below it, a request routes as if it had no document
ROUTINGS = ("context", "random")  # `--routing`: by context_key (random without one), or always at random
_PATHS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}


def _before_last_newline(text: str) -> str:
    body = text.rstrip("\n")
    return body[:body.rindex("\n") + 1] if "\n" in body else ""


def document_of(path: str, body: bytes) -> list[tuple[str, str]] | None:
    """The request's document as (role, text) pairs, or None when ``body`` is no valid request for ``path``."""
    schema = _PATHS.get(path)
    if schema is None:
        return None
    try:
        req = parse_body(body, schema)
        if schema is CompletionRequest:
            return [("prompt", _before_last_newline(req.text()))]
    except APIError:
        return None
    users = [i for i, m in enumerate(req.messages) if m.role == "user"]
    if not users:
        return None
    first = users[0]
    return [(m.role, m.text) for m in req.messages[:first]] + [("user", _before_last_newline(req.messages[first].text))]


def context_key(path: str, body: bytes) -> str | None:
    """The hex sha256 of the request's document (see the module docstring); None: no document worth a replica."""
    document = document_of(path, body)
    if document is None or sum(len(text) for _, text in document) < MIN_DOCUMENT_CHARS:
        return None
    return hashlib.sha256(json.dumps(document, ensure_ascii=False).encode()).hexdigest()


def _weight(key: str, replica: str) -> bytes:
    return hashlib.sha256(f"{key}\x00{replica}".encode()).digest()


def rank(key: str, replicas: list[str]) -> list[str]:
    """``replicas`` (their ids) best first for ``key``: the first is the key's replica, the rest its fallbacks."""
    return sorted(replicas, key=lambda replica: _weight(key, replica), reverse=True)
