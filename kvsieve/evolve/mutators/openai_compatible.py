"""A mutator that asks any OpenAI-compatible ``/chat/completions`` endpoint, with the standard library only."""

from __future__ import annotations

import http.client
import json
import os
import random
import time
import urllib.error
import urllib.request

from kvsieve.evolve.mutators.prompting import CountingMutator, ScoreLookup, build_messages, check_edit_format
from kvsieve.language.program_source import Program

__all__ = ["OpenAIMutator"]


class _ReplyError(ValueError):
    """A response that is not a usable chat completion (bad JSON, missing fields)."""


class OpenAIMutator(CountingMutator):
    """Asks an OpenAI-compatible chat-completions endpoint (vLLM, llama.cpp, Ollama, hosted APIs).

    The API key is read from ``api_key_env`` at each call and never stored, so it cannot leak into
    reprs, logs or saved run configs. Transport errors count in ``failed`` (``last_error`` keeps the
    reason, key redacted); replies without a program count in ``malformed``.
    """

    name = "openai"

    def __init__(self, base_url: str, model: str, api_key_env: str = "OPENAI_API_KEY", edit_format: str = "block",
                 temperature: float = 0.8, timeout_s: float = 120, max_tokens: int = 1024,
                 score_of: ScoreLookup | None = None) -> None:
        if not isinstance(base_url, str) or not base_url.strip():
            raise ValueError("base_url must be a non-empty URL such as 'http://localhost:8000/v1'")
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url {base_url!r} must start with http:// or https://")
        if not isinstance(model, str) or not model.strip():
            raise ValueError("model must be a non-empty model name")
        if not api_key_env:
            raise ValueError("api_key_env must name an environment variable")
        check_edit_format(edit_format)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.base_url, self.model, self.api_key_env = base_url, model, api_key_env
        self.edit_format, self.temperature = edit_format, temperature
        self.timeout_s, self.max_tokens = timeout_s, max_tokens
        self.score_of = score_of
        self.proposed = self.malformed = self.unchanged = self.failed = 0
        self.seconds = 0.0
        self.last_error: str | None = None
        self.last_reply = None

    @property
    def url(self) -> str:
        return f"{self.base_url.rstrip('/')}/chat/completions"

    def __repr__(self) -> str:
        return (f"OpenAIMutator(base_url={self.base_url!r}, model={self.model!r}, api_key_env={self.api_key_env!r}, "
                f"edit_format={self.edit_format!r})")

    def complete(self, messages: list[dict[str, str]], seed: int) -> str:
        """The assistant content of one chat completion; raises OSError/HTTPException/ValueError on failure."""
        body = {"model": self.model, "messages": messages, "temperature": self.temperature,
                "max_tokens": self.max_tokens, "seed": seed}
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        key = os.environ.get(self.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310 - http(s) only
            raw = response.read()
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise _ReplyError(f"response is not JSON: {raw[:120]!r}") from err
        try:
            content = data["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError) as err:
            raise _ReplyError(f"response has no choices[0].message.content: {str(data)[:200]}") from err
        if not isinstance(content, str):
            raise _ReplyError(f"choices[0].message.content is {type(content).__name__}, not text")
        return content

    def _redact(self, message: str) -> str:
        key = os.environ.get(self.api_key_env)
        return message.replace(key, "***") if key else message

    def propose(self, parent: Program, inspirations: list[Program], rng: random.Random) -> Program | None:
        """A child from one completion; None (counted in ``failed`` or ``malformed``) when there is none."""
        seed = rng.getrandbits(31)  # 31 bits: some servers reject seeds outside int32
        parent_score, inspiration_scores = self._scores(parent, inspirations)
        messages = build_messages(parent, inspirations, parent_score, inspiration_scores, self.edit_format)
        self.proposed += 1
        start = time.perf_counter()
        try:
            reply = self.complete(messages, seed)
        except urllib.error.HTTPError as err:
            detail = err.read()[:200].decode("utf-8", "replace") if err.fp is not None else ""
            return self._fail(f"HTTP {err.code} {err.reason}: {detail}".strip())
        except (OSError, http.client.HTTPException, ValueError) as err:
            return self._fail(f"{type(err).__name__}: {err}")
        finally:
            self.seconds += time.perf_counter() - start
        return self._child(parent, reply, self.edit_format)

    def _fail(self, message: str) -> None:
        self.failed += 1
        self.last_error = self._redact(message)
        return None
