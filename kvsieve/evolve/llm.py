"""LLM mutators: ask a language model to rewrite a parent program, parse its reply into a child source.

Two back ends share one prompt (:func:`build_messages`) and one reply parser: :class:`LocalLLMMutator`
samples from an in-process causal LM (the bundled Qwen2.5-Coder by default), :class:`OpenAIMutator`
POSTs to any OpenAI-compatible ``/chat/completions`` endpoint with the standard library only.

A mutator only produces source text; it never compiles or runs it (the static check and the sandbox
do). A reply that yields no program is counted (``malformed``, or ``failed`` for transport errors)
and ``propose`` returns ``None``: one bad sample must never stop a search.
"""

from __future__ import annotations

import http.client
import inspect
import json
import os
import random
import re
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from kvsieve.evolve import features as feats
from kvsieve.evolve.program import SELECTION_RANGES, Program

__all__ = ["EDIT_FORMATS", "interface_doc", "build_messages", "extract_program", "apply_search_replace",
           "LocalLLMMutator", "OpenAIMutator"]

EDIT_FORMATS = ("block", "diff")
DEFAULT_LOCAL_MODEL = "qwen2.5-coder-0.5b-instruct"

_SHAPES = {"b": "batch", "h": "KV heads", "g": "query heads per KV head", "n": "cached context entries"}


# --- the prompt -------------------------------------------------------------------------------------


def _field_docs() -> dict[str, str]:
    """Field descriptions parsed from the ``Features`` docstring, so the prompt follows features.py."""
    doc = inspect.getdoc(feats.Features) or ""
    _, _, section = doc.partition("Attributes:")
    out: dict[str, str] = {}
    names: list[str] = []
    for line in section.splitlines():
        stripped = line.strip()
        head, sep, rest = stripped.partition(":")
        candidates = [name.strip() for name in head.split(",")]
        if sep and candidates and all(name.isidentifier() for name in candidates):
            names = candidates
            for name in names:
                out[name] = rest.strip()
        elif stripped and names:
            for name in names:
                out[name] = f"{out[name]} {stripped}"
    return out


def _helper_line(name: str, fn: Callable) -> str:
    try:
        params = inspect.signature(fn).parameters.values()
        signature = "(" + ", ".join(p.name if p.default is p.empty else f"{p.name}={p.default!r}"
                                    for p in params) + ")"
    except (TypeError, ValueError):
        signature = "(...)"
    first = (inspect.getdoc(fn) or "").strip().splitlines()
    return f"- {name}{signature}: {_plain(first[0])}" if first else f"- {name}{signature}"


def _plain(text: str) -> str:
    return text.replace("``", "`")


@lru_cache(maxsize=1)
def interface_doc() -> str:
    """The compact interface a program is written against, generated from features.py and program.py.

    Generated rather than hand written so the prompt can never promise a name the static check rejects.
    """
    docs = _field_docs()
    shared: dict[str, list[str]] = {}  # one line for fields documented together (key_norm, value_norm)
    for name in (*feats.TENSOR_FIELDS, *feats.SCALAR_FIELDS):
        shared.setdefault(docs.get(name, "") or name, []).append(name)
    fields = []
    for described, names in shared.items():
        kind = "tensor" if names[0] in feats.TENSOR_FIELDS else "number"
        label = ", ".join(f"f.{name}" for name in names)
        fields.append(f"- {label} ({kind}): {_plain(described)}" if described not in names else f"- {label} ({kind})")
    methods = [f".{m}()" for m in feats.TENSOR_METHODS if m not in ("shape", "values", "indices")]
    attributes = [f".{m}" for m in feats.TENSOR_METHODS if m in ("shape", "values", "indices")]
    selection = ", ".join(f'"{key}": int in [{lo}, {hi}]' for key, (lo, hi) in SELECTION_RANGES.items())
    constants = ", ".join(sorted(getattr(feats, "MATH_CONSTANTS", {})))
    shapes = ", ".join(f"{k} = {v}" for k, v in _SHAPES.items())
    lines = [
        "A program is one Python file: a docstring, an optional literal SELECTION dict, and def score(f).",
        "score(f) gets the features of one layer and returns one float score per cached entry and KV head,",
        "shape (b, h, n) (the shape of f.key_norm). Higher scores are kept; the lowest are evicted.",
        f"Shapes: {shapes}.",
        "",
        "Fields of f (tensors are float32 and read-only):",
        *fields,
        "",
        "torch functions (call as torch.NAME): " + ", ".join(feats.TORCH_FUNCTIONS),
        "tensor methods: " + ", ".join(methods) + ("; attributes: " + ", ".join(attributes) if attributes else ""),
        "builtins: " + ", ".join(feats.SAFE_BUILTINS) + (f"; constants: {constants}" if constants else ""),
        "helpers (call by name, no prefix):",
        *(_helper_line(name, fn) for name, fn in feats.HELPERS.items()),
        "",
        f"SELECTION (optional literal dict, these keys only): {{{selection}}}.",
        "chunk_size keeps or evicts whole chunks of that many entries; sink always keeps the first entries.",
        "",
        "Rules:",
        "- no import statements; torch and the helpers above are already in scope, nothing else is",
        "- no string literals except the module docstring and the SELECTION keys",
        "- no names or attributes that start with an underscore (no dunders)",
        "- no file, network or interpreter access; only the functions, methods and names listed above",
        "- return finite float scores of shape (b, h, n); higher = keep",
        "- define only score(f); no other functions, classes, lambdas, comprehensions or globals",
        "- inside score: assignments to new local names, if, return, and for loops over range(...) with "
        "literal int bounds only (no while)",
        "- the last f.window entries are always kept by the engine; do not special-case them",
    ]
    return "\n".join(lines)


def _check_edit_format(edit_format: str) -> None:
    if edit_format not in EDIT_FORMATS:
        raise ValueError(f"edit_format {edit_format!r} is not supported; use one of {list(EDIT_FORMATS)}")


def _format_score(score: float | None) -> str:
    return "not measured yet" if score is None else f"{score:.4g}"


def build_messages(parent: Program, inspirations: Sequence[Program], parent_score: float | None,
                   inspiration_scores: Sequence[float | None], edit_format: str) -> list[dict[str, str]]:
    """System and user chat messages asking for a better child of ``parent``.

    The inspirations show other scored programs so the model can combine ideas instead of only
    perturbing one; ``edit_format`` picks a whole rewritten program (``block``) or SEARCH/REPLACE
    edits of the parent (``diff``, cheaper for large models, unreliable for small ones).
    """
    _check_edit_format(edit_format)
    if len(inspiration_scores) != len(inspirations):
        raise ValueError(f"got {len(inspirations)} inspirations but {len(inspiration_scores)} inspiration scores")
    system = (
        "You are an expert in transformer inference who writes small Python programs that decide which "
        "KV-cache entries to evict when a long context is compressed. The compressed cache must still let "
        "the model retrieve facts (needles, passages, code) from anywhere in the context.\n\n"
        + interface_doc()
    )
    parts = [
        "Improve this KV-cache eviction program. Its score (higher is better: the task score of "
        f"long-context retrieval with the compressed cache) is {_format_score(parent_score)}.",
        "",
        "```python",
        parent.source.rstrip("\n"),
        "```",
    ]
    for i, (program, score) in enumerate(zip(inspirations, inspiration_scores), start=1):
        parts += ["", f"Other program {i} (score {_format_score(score)}):", "```python",
                  program.source.rstrip("\n"), "```"]
    parts.append("")
    parts.append("Propose one change that should raise the score: a different combination of the signals, "
                 "smoothing, normalisation, per-layer behaviour or SELECTION values. Keep it short and "
                 "follow the rules.")
    if edit_format == "block":
        parts.append("Reply with the whole rewritten program in a single ```python fenced block "
                     "(docstring, optional SELECTION, def score(f)), then stop.")
    else:
        parts += [
            "Reply with one or more SEARCH/REPLACE blocks that edit the first program, in this format:",
            "<<<<<<< SEARCH",
            "old lines, copied exactly from the program",
            "=======",
            "new lines",
            ">>>>>>> REPLACE",
            "Each SEARCH part must match exactly one place in the program. Reply with the blocks only.",
        ]
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n".join(parts)}]


# --- reply parsing ----------------------------------------------------------------------------------

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
_PYTHON_TAGS = ("python", "py", "python3")


def _strip_reasoning(reply: str) -> str:
    """Drop ``<think>`` sections: reasoning models may sketch code there that is not the answer."""
    return _THINK.sub("", reply)


def extract_program(reply: str) -> str | None:
    """The first ```python fenced block of ``reply`` (else the first fenced block), dedented; None if none.

    An unclosed fence (a reply cut off at the token limit) is no program: its end is missing.
    """
    blocks: list[tuple[str, str]] = []
    lines = _strip_reasoning(reply).splitlines()
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if not stripped.startswith("```"):
            i += 1
            continue
        words = stripped[3:].strip().split()
        tag = words[0].lower() if words else ""
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            break
        body = textwrap.dedent("\n".join(lines[i + 1:end])).strip("\n")
        blocks.append((tag, body))
        i = end + 1
    for tag, body in blocks:
        if tag in _PYTHON_TAGS and body.strip():
            return body + "\n"
    for _, body in blocks:
        if body.strip():
            return body + "\n"
    return None


_SEARCH = re.compile(r"^<{5,9} ?SEARCH\s*$")
_DIVIDER = re.compile(r"^={5,9}\s*$")
_REPLACE = re.compile(r"^>{5,9} ?REPLACE\s*$")


def _parse_edits(reply: str) -> list[tuple[list[str], list[str]]] | None:
    edits: list[tuple[list[str], list[str]]] = []
    state, search, replace = "out", [], []
    for line in _strip_reasoning(reply).splitlines():
        stripped = line.strip()
        if state == "out":
            if _SEARCH.match(stripped):
                state, search, replace = "search", [], []
        elif state == "search":
            if _DIVIDER.match(stripped):
                state = "replace"
            elif _SEARCH.match(stripped) or _REPLACE.match(stripped):
                return None
            else:
                search.append(line)
        else:
            if _REPLACE.match(stripped):
                edits.append((search, replace))
                state = "out"
            elif _SEARCH.match(stripped) or _DIVIDER.match(stripped):
                return None
            else:
                replace.append(line)
    if state != "out" or not edits:
        return None
    return edits


def apply_search_replace(source: str, reply: str) -> str | None:
    """``source`` with every SEARCH/REPLACE block of ``reply`` applied in order; None if any fails.

    Each SEARCH part must equal exactly one run of whole lines of the current source (trailing
    whitespace ignored): an edit that matches nowhere or twice is ambiguous, and a half-applied
    reply is a program nobody asked for.
    """
    edits = _parse_edits(reply)
    if edits is None:
        return None
    lines = source.splitlines()
    for search, replace in edits:
        if not any(line.strip() for line in search):
            return None
        k = len(search)
        wanted = [line.rstrip() for line in search]
        hits = [i for i in range(len(lines) - k + 1) if [line.rstrip() for line in lines[i:i + k]] == wanted]
        if len(hits) != 1:
            return None
        lines[hits[0]:hits[0] + k] = replace
    return "\n".join(lines) + "\n"


# --- mutators ---------------------------------------------------------------------------------------

ScoreLookup = Callable[[Program], float | None]


class _Counting:
    """Counters shared by both back ends (read by the search loop's log)."""

    proposed: int
    malformed: int
    unchanged: int  # children whose syntax tree equals the parent's (small models often copy)
    seconds: float
    last_reply: str | None
    score_of: ScoreLookup | None

    def _scores(self, parent: Program, inspirations: Sequence[Program]) -> tuple[float | None, list[float | None]]:
        if self.score_of is None:
            return None, [None] * len(inspirations)
        return self.score_of(parent), [self.score_of(p) for p in inspirations]

    def _child(self, parent: Program, reply: str, edit_format: str) -> Program | None:
        self.last_reply = reply
        if edit_format == "diff":
            source = apply_search_replace(parent.source, reply)
        else:
            source = extract_program(reply)
        if source is None or not source.strip():
            self.malformed += 1
            return None
        child = Program(source)
        if child.code_hash == parent.code_hash:
            self.unchanged += 1
        return child


class LocalLLMMutator(_Counting):
    """Samples rewrites from an in-process causal LM (loaded lazily so building the mutator is free).

    Always asks for whole ``block`` rewrites: sub-billion models rarely keep a diff format intact.
    Sampling draws from a ``torch.Generator`` seeded by the search's ``rng``, so a run is reproducible
    and does not touch torch's global RNG.
    """

    name = "local"

    def __init__(self, model: Any = None, tokenizer: Any = None, model_name: str = DEFAULT_LOCAL_MODEL,
                 dtype: str = "auto", max_new_tokens: int = 512, temperature: float = 0.8, top_p: float = 0.95,
                 score_of: ScoreLookup | None = None) -> None:
        if (model is None) != (tokenizer is None):
            raise ValueError("give both model and tokenizer, or neither (then model_name is loaded)")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self._model, self._tokenizer = model, tokenizer
        self.model_name, self.dtype = model_name, dtype
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.score_of = score_of
        self.proposed = self.malformed = self.unchanged = 0
        self.seconds = 0.0
        self.last_reply = None

    def __repr__(self) -> str:
        return (f"LocalLLMMutator(model_name={self.model_name!r}, max_new_tokens={self.max_new_tokens}, "
                f"temperature={self.temperature}, top_p={self.top_p})")

    def _loaded(self) -> tuple[Any, Any]:
        if self._model is None:
            from kvsieve.models import load

            self._model, self._tokenizer = load(self.model_name, dtype=self.dtype)
        return self._model, self._tokenizer

    def _prompt(self, messages: list[dict[str, str]]) -> str:
        tokenizer = self._tokenizer
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return "".join(f"{m['role']}:\n{m['content']}\n\n" for m in messages) + "assistant:\n"

    def generate(self, messages: list[dict[str, str]], seed: int) -> str:
        """The model's reply to ``messages``, sampled with a generator seeded by ``seed``."""
        import torch
        from transformers import LogitsProcessorList

        model, tokenizer = self._loaded()
        encoded = tokenizer(self._prompt(messages), return_tensors="pt", add_special_tokens=False)
        device = getattr(model, "device", torch.device("cpu"))
        ids = encoded["input_ids"].to(device)
        mask = encoded.get("attention_mask")
        sampler = _SeededSampler(torch.Generator().manual_seed(seed), self.temperature, self.top_p)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=None if mask is None else mask.to(device),
                                 max_new_tokens=self.max_new_tokens, do_sample=False,
                                 logits_processor=LogitsProcessorList([sampler]), pad_token_id=pad)
        self.seconds += time.perf_counter() - start
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    def propose(self, parent: Program, inspirations: list[Program], rng: random.Random) -> Program | None:
        """A child from one sampled reply; None (counted in ``malformed``) when the reply holds no program."""
        seed = rng.getrandbits(63)
        parent_score, inspiration_scores = self._scores(parent, inspirations)
        messages = build_messages(parent, inspirations, parent_score, inspiration_scores, "block")
        self.proposed += 1
        return self._child(parent, self.generate(messages, seed), "block")


class _SeededSampler:
    """A logits processor that samples the next token itself and leaves only it possible.

    ``generate`` then runs greedily and picks that token: sampling uses our generator instead of
    torch's global RNG, while the model's own processors (repetition penalty, ...) still apply first.
    """

    def __init__(self, generator: Any, temperature: float, top_p: float) -> None:
        self.generator, self.temperature, self.top_p = generator, temperature, top_p

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        logits = scores.float().cpu()
        if self.temperature == 0:
            chosen = logits.argmax(dim=-1)
        else:
            probs = torch.softmax(logits / self.temperature, dim=-1)
            if self.top_p < 1:
                sorted_probs, order = probs.sort(dim=-1, descending=True)
                before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
                sorted_probs = sorted_probs.masked_fill(before >= self.top_p, 0.0)
                probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
            chosen = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(-1, chosen.to(scores.device)[:, None], 0.0)
        return out


class _ReplyError(ValueError):
    """A response that is not a usable chat completion (bad JSON, missing fields)."""


class OpenAIMutator(_Counting):
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
        _check_edit_format(edit_format)
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
