"""Mutators: propose a child program from a parent and a few inspirations, one back end per file.

- ``structural.py``: edits of the syntax tree, no language model (the default);
- ``random_programs.py``: a fresh random program each time, parent and scores unread (a control);
- ``mixed.py``: structural edits of the parent, or random terms (``random_programs``'s) grafted into it;
- ``local_model.py``: an in-process causal LM (the bundled coder model);
- ``constrained.py``: the same, decoding under the language's typed grammar (every proposal passes stage 0);
- ``openai_compatible.py``: any OpenAI-compatible endpoint.

All implement :class:`~kvsieve.evolve.mutators.base.Mutator`; ``prompting.py`` holds what the two LLM
back ends share. :func:`make_mutator` builds the one a config names.
"""

from __future__ import annotations

from kvsieve.evolve.evolve_config import EvolveConfig
from kvsieve.evolve.mutators.base import Mutator
from kvsieve.evolve.mutators.constrained import ConstrainedLLMMutator
from kvsieve.evolve.mutators.local_model import LocalLLMMutator
from kvsieve.evolve.mutators.mixed import MixedMutator
from kvsieve.evolve.mutators.openai_compatible import OpenAIMutator
from kvsieve.evolve.mutators.random_programs import RandomProgramMutator
from kvsieve.evolve.mutators.structural import StructuralMutator

__all__ = ["Mutator", "StructuralMutator", "RandomProgramMutator", "MixedMutator", "LocalLLMMutator",
           "ConstrainedLLMMutator", "OpenAIMutator", "LLM_MUTATORS", "make_mutator"]

LLM_MUTATORS = ("local", "constrained")  # the in-process LLM back ends (they load a coder model)


def make_mutator(config: EvolveConfig, model=None, tokenizer=None, coder: tuple | None = None) -> Mutator:
    """The mutator ``config`` names. ``model``/``tokenizer``: the evaluated model, reused by an LLM mutator whose
    ``local_model`` it is; ``coder``: an LLM mutator's own (model, tokenizer), already loaded (a study's LLM runs
    share one copy instead of loading one each)."""
    if config.mutator == "structural":
        return StructuralMutator()
    if config.mutator == "random":
        return RandomProgramMutator()
    if config.mutator == "mixed":
        return MixedMutator()
    if config.mutator in LLM_MUTATORS:
        if coder is None and model is not None and config.local_model == config.model:
            coder = (model, tokenizer)
        cls = ConstrainedLLMMutator if config.mutator == "constrained" else LocalLLMMutator
        return cls(model_name=config.local_model, model=coder[0] if coder else None,
                   tokenizer=coder[1] if coder else None, dtype=config.dtype, max_new_tokens=config.llm_max_new_tokens)
    return OpenAIMutator(config.llm_base_url, config.llm_model, api_key_env=config.llm_api_key_env,
                         edit_format=config.llm_edit_format, max_tokens=config.llm_max_new_tokens)
