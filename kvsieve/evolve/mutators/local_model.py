"""A mutator that samples rewrites from an in-process causal LM (the bundled Qwen2.5-Coder by default)."""

from __future__ import annotations

import random
import time
from typing import Any

from kvsieve.evolve.mutators.prompting import DEFAULT_LOCAL_MODEL, CountingMutator, ScoreLookup, build_messages
from kvsieve.language.program_source import Program
from kvsieve.models import load

__all__ = ["LocalLLMMutator"]


class LocalLLMMutator(CountingMutator):
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
            self._model, self._tokenizer = load(self.model_name, dtype=self.dtype)
        return self._model, self._tokenizer

    def _prompt(self, messages: list[dict[str, str]]) -> str:
        tokenizer = self._tokenizer
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return "".join(f"{m['role']}:\n{m['content']}\n\n" for m in messages) + "assistant:\n"

    def _constraints(self, tokenizer: Any, prompt_length: int) -> list:
        """Logits processors that run before sampling (none here; the constrained mutator masks by its grammar)."""
        return []

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
                                 logits_processor=LogitsProcessorList([*self._constraints(tokenizer, ids.shape[1]),
                                                                       sampler]), pad_token_id=pad)
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
