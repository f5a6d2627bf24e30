"""The grammar-constrained LLM mutator: whatever the model prefers, every proposal is a program stage 0 accepts.

A tiny randomly initialised Llama with SmolLM2's real tokenizer (so the grammar's tokens are a real vocabulary)
samples nearly uniformly among the tokens the grammar allows: the hardest case for staying inside it."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from kvsieve.evolve.evolve_config import EvolveConfig
from kvsieve.evolve.mutators import ConstrainedLLMMutator, LocalLLMMutator, make_mutator
from kvsieve.evolve.seeds import SEEDS
from kvsieve.language.program_source import Program
from kvsieve.language.static_check import check_source

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_coder(smollm2):
    tokenizer = smollm2[1]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval(), tokenizer


def test_every_proposal_of_the_constrained_mutator_passes_stage_0(tiny_coder):
    model, tokenizer = tiny_coder
    mutator = ConstrainedLLMMutator(model=model, tokenizer=tokenizer, max_new_tokens=160, temperature=1.0)
    rng = random.Random(0)
    parent, inspirations = Program(SEEDS["snapkv"]), [Program(SEEDS["tova"])]
    proposals = [mutator.propose(parent, inspirations, rng) for _ in range(4)]
    made = [p for p in proposals if p is not None]
    assert len(made) >= 2, [mutator.last_reply]
    for child in made:
        check_source(child.source)  # raises if the grammar let anything else through
    assert mutator.malformed == len(proposals) - len(made)  # a reply cut off at the budget is counted, never kept


def test_the_unconstrained_mutator_on_the_same_model_writes_no_program(tiny_coder):
    """The control: the same random model without the grammar does not even produce a fenced block."""
    model, tokenizer = tiny_coder
    mutator = LocalLLMMutator(model=model, tokenizer=tokenizer, max_new_tokens=40, temperature=1.0)
    proposals = [mutator.propose(Program(SEEDS["snapkv"]), [], random.Random(0))]
    assert proposals == [None] and mutator.malformed == 1


def test_the_config_names_the_constrained_mutator(tiny_coder):
    model, tokenizer = tiny_coder
    config = EvolveConfig(mutator="constrained", local_model="smollm2-135m-instruct", model="smollm2-135m-instruct")
    assert isinstance(make_mutator(config, model, tokenizer), ConstrainedLLMMutator)
    # a coder loaded once and handed to every LLM mutator of a study: none loads its own (here the qwen default)
    shared = [make_mutator(EvolveConfig(mutator=m), coder=(model, tokenizer)) for m in ("constrained", "local")]
    assert all(m._loaded() == (model, tokenizer) for m in shared)
    with pytest.raises(ValueError, match="'constrained'"):
        EvolveConfig(mutator="grammar")
