"""Request bodies of the OpenAI endpoints kvsieve serves, validated strictly.

Types are strict (``"max_tokens": "8"`` is an error, not 8) and unknown fields are refused with the list of
allowed ones: a typo in a field should not silently change nothing. Value ranges that depend on the prompt
or the server (``max_tokens``, the context length) are checked later, in ``app``.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvsieve.serve.errors import APIError, quoted

__all__ = ["KvsieveOptions", "TextPart", "ChatMessage", "StreamOptions", "ChatCompletionRequest",
           "CompletionRequest", "MAX_JSON_DEPTH", "json_depth", "parse_body"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class KvsieveOptions(_Strict):
    """``extra_body={"kvsieve": {...}}``: the request's task family, or a stricter point than the contract's."""

    task: str | None = None  # routes task and task-family contracts
    full_kv: bool = False  # always allowed: no compression at all
    ratio: float | None = None  # the contract's policy at this ratio; stricter (lower) unless --allow-override
    policy: str | None = None  # another policy: only with --allow-override


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str
    max_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    kvsieve: KvsieveOptions = Field(default_factory=KvsieveOptions)

    def stops(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stops) > 4 or any(not s for s in stops):
            got = f"{len(stops)} strings" if len(stops) > 4 else f"an empty one ({quoted(stops)})"
            raise APIError(400, f"stop must be up to 4 non-empty strings, got {got}", "stop")
        return stops

    def check_sampling(self) -> None:
        """kvsieve decodes greedily, one choice: refuse what would ask for anything else."""
        if self.temperature not in (None, 0, 0.0):
            raise APIError(400, f"temperature {self.temperature!r} is not supported: kvsieve serve decodes greedily "
                                "(omit it or pass 0)", "temperature")
        if self.top_p not in (None, 1, 1.0):
            raise APIError(400, f"top_p {self.top_p!r} is not supported: decoding is greedy (omit it or pass 1)",
                           "top_p")
        if self.n not in (None, 1):
            raise APIError(400, f"n {self.n!r} is not supported: one choice per request (omit it or pass 1)", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise APIError(400, f"{name} {getattr(self, name)!r} is not supported (omit it or pass 0)", name)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[str]
    echo: bool = False
    logprobs: int | None = None

    def text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise APIError(400, f"prompt must be one string (or a list of one), got a list of {len(self.prompt)}",
                           "prompt")
        return self.prompt[0]


def _describe(error: dict, schema: type[BaseModel]) -> tuple[str, str]:
    where = ".".join(str(p) for p in error["loc"])
    if error["type"] == "extra_forbidden":
        owner: type[BaseModel] = schema
        for part in error["loc"][:-1]:  # walk to the nested model that refused the field
            field = owner.model_fields.get(str(part)) if isinstance(part, str) else None
            annotation = getattr(field, "annotation", None)
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                owner = annotation
        allowed = ", ".join(sorted(owner.model_fields))
        return where[:80], f"unknown field {quoted(where)}; allowed: {allowed}"
    return where[:80], f"{where[:80]}: {error['msg']} (got {json.dumps(error.get('input'), default=str)[:80]})"


MAX_JSON_DEPTH = 16  # the deepest a valid body nests is 5 (body, messages, message, content, part)
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPEN, _CLOSE = np.zeros(256, dtype=np.int8), np.zeros(256, dtype=np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_CLOSE[[ord("]"), ord("}")]] = 1


_WINDOW = 1 << 16  # bytes scanned at once: the scan's scratch (~50 bytes a byte) is bounded by it, not the body


def json_depth(raw: bytes, window: int = _WINDOW) -> int:
    """How deep ``raw``'s arrays and objects nest (brackets inside strings do not count), without parsing it:
    the parser recurses once per level, so a deep body must be refused before it is parsed.

    Linear time, in numpy: a quote opens or closes a string unless an odd run of backslashes precedes it; a
    bracket counts when an even number of such quotes precede it. (A regex that skips strings backtracks
    quadratically on a string that never closes.) Exact on valid JSON; on invalid JSON it may count brackets the
    parser would never reach, which only refuses a body that fails to parse anyway. The body is scanned ``window``
    bytes at a time, carrying three numbers across windows, so its scratch memory does not grow with the body."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive number of bytes, got {window!r}")
    data = np.frombuffer(raw, dtype=np.uint8)
    run = 0  # parity of the run of backslashes ending the bytes scanned so far
    strings = 0  # parity of the unescaped quotes scanned so far: 1 inside a string
    depth = deepest = 0
    for start in range(0, data.size, window):
        part = data[start : start + window]
        index = np.arange(part.size)
        # for each byte, the index of the last byte before it that is not a backslash; a run of backslashes that
        # ends the previous window counts as if that byte were at -1 - run
        before = -1 - run
        not_backslash = np.where(part != _BACKSLASH, index, before)
        last = np.maximum.accumulate(np.concatenate(([before], not_backslash[:-1])))
        escaped = (index - 1 - last) % 2 == 1  # preceded by an odd run of backslashes
        run = (part.size - 1 - max(int(not_backslash.max()), before)) % 2
        quotes = np.cumsum((part == _QUOTE) & ~escaped) + strings
        inside = quotes % 2 == 1  # a quote's own byte counts as inside: it is no bracket anyway
        strings = int(quotes[-1]) % 2
        levels = np.cumsum((_OPEN[part] - _CLOSE[part]) * ~inside, dtype=np.int64) + depth
        deepest, depth = max(deepest, int(levels.max())), int(levels[-1])
    return deepest


def _surrogate(data, where: str = "") -> tuple[str, int] | None:
    """(the field, character offset) of the first string in ``data`` holding a lone surrogate (``"\\ud800"`` is
    valid JSON, but no Unicode scalar value: a tokenizer refuses it), or None."""
    if isinstance(data, str):
        match = _SURROGATES.search(data)
        return None if match is None else (where or "body", match.start())
    if isinstance(data, dict):
        for key, value in data.items():
            path = f"{where}.{key}" if where else str(key)
            found = _surrogate(key, f"a field name in {where or 'the body'}") or _surrogate(value, path)
            if found:
                return found
    elif isinstance(data, list):
        for i, value in enumerate(data):
            found = _surrogate(value, f"{where}.{i}")
            if found:
                return found
    return None


_SURROGATES = re.compile("[\ud800-\udfff]")


def parse_body(raw: bytes, schema: type[_Common]) -> _Common:
    """The validated request, or an APIError: 400 for a body that is not a JSON object (or nests deeper than
    :data:`MAX_JSON_DEPTH`), 422 for bad fields."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise APIError(400, f"the request body is not UTF-8: {err.reason} at byte {err.start}") from None
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise APIError(400, f"the request body nests {depth} levels of arrays and objects; at most {MAX_JSON_DEPTH} "
                            "are allowed")
    try:
        data = json.loads(text) if text else None
    except json.JSONDecodeError as err:
        raise APIError(400, f"the request body is not valid JSON: {err}") from None
    if not text:
        raise APIError(400, "the request body is empty: send a JSON object such as {\"model\": ..., \"messages\": "
                            "[...]}")
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    lone = _surrogate(data)
    if lone is not None:
        field, at = lone
        raise APIError(400, f"{field} holds a lone UTF-16 surrogate (character {at}): text must be Unicode scalar "
                            "values (a surrogate pair escapes one character above U+FFFF)", field)
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        param, message = _describe(err.errors()[0], schema)
        raise APIError(422, message, param, "invalid_value") from err
