"""End to end on the real bundled SmolLM2-135M: a 1k-token needle in a haystack."""

import random

import pytest

from kvsieve.engine.generate import generate
from kvsieve.policies import get

pytestmark = pytest.mark.model

NOUNS = "river garden teacher window mountain letter engine village market candle harbor forest doctor bridge".split()
VERBS = "visits paints follows repairs describes watches carries finds builds opens".split()
ADJECTIVES = "quiet old bright narrow golden busy distant gentle heavy famous".split()
NEEDLE = "One of the special magic numbers for purple-lake is: 4819273."
QUESTION = "What is the special magic number for purple-lake mentioned in the provided text?"
PREFIX = "The special magic number for purple-lake mentioned in the provided text is"


def haystack_with_needle(sentences: int, depth: float, seed: int = 0) -> str:
    rng = random.Random(seed)
    text = [
        f"The {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} {rng.choice(VERBS)} the {rng.choice(NOUNS)} "
        f"near the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}."
        for _ in range(sentences)
    ]
    text.insert(int(depth * sentences), NEEDLE)
    return " ".join(text)


def _dtypes() -> list[str]:
    """The dtype a user gets here (auto) and float32, the one every AVX2-only CPU gets: on a machine with
    native bf16 both paths run; where auto already is float32 it runs once."""
    from kvsieve.models import resolve_dtype

    auto = str(resolve_dtype("auto")).removeprefix("torch.")
    return sorted({auto, "float32"})


@pytest.fixture(scope="module", params=_dtypes())
def smollm2(request):
    from kvsieve.models import load

    return load("smollm2-135m", dtype=request.param)


@pytest.mark.parametrize("depth", [0.25, 0.75])
def test_needle_found_with_full_cache_and_query_agnostic_kvzip(smollm2, depth):
    import kvsieve

    model, tokenizer = smollm2
    context = haystack_with_needle(80, depth)
    full = generate(model, tokenizer, context, QUESTION, answer_prefix=PREFIX, max_new_tokens=10)
    assert 900 <= full.context_tokens <= 1200
    assert "4819273" in full.text
    # KVzip keeps what the model needs to repeat the context, without seeing the question
    kvzip = kvsieve.policies.get("kvzip", tokenizer=tokenizer)
    zipped = generate(model, tokenizer, context, QUESTION, kvzip, ratio=0.5, answer_prefix=PREFIX, max_new_tokens=10)
    assert "4819273" in zipped.text
    valid = sum(layer.valid_tokens_after for layer in zipped.report.layers) / len(zipped.report.layers)
    assert valid == pytest.approx(0.5 * zipped.context_tokens, abs=2)  # half the entries, on average
    assert zipped.cache_bytes_kept < 0.8 * zipped.cache_bytes_full  # stored at each layer's widest head


def test_query_agnostic_prefill_then_question_keeps_positions(smollm2):
    model, tokenizer = smollm2
    context = haystack_with_needle(80, 0.5)
    # streaming_llm keeps the sinks and the most recent half: the needle (at the middle) survives
    out = generate(model, tokenizer, context, QUESTION, get("streaming_llm"), ratio=0.4, answer_prefix=PREFIX,
                   max_new_tokens=10)
    assert "4819273" in out.text
    assert max(out.kept_tokens) == round(out.context_tokens * 0.6)


def test_decode_time_eviction_on_a_real_model(smollm2):
    model, tokenizer = smollm2
    context = haystack_with_needle(80, 0.9)
    out = generate(model, tokenizer, context, QUESTION, get("streaming_llm"), kept=512, mode="decode", chunk_size=128,
                   answer_prefix=PREFIX, max_new_tokens=10)
    assert max(out.kept_tokens) <= 512
    assert "4819273" in out.text


@pytest.mark.parametrize("separator_in_context", [True, False])
def test_prompt_context_ends_with_the_newline_before_the_question(smollm2, separator_in_context):
    from kvsieve.prompt import build_prompt

    _, tokenizer = smollm2
    context = haystack_with_needle(20, 0.5)
    prompt = build_prompt(tokenizer, context, QUESTION, PREFIX, separator_in_context=separator_in_context)
    last = tokenizer.decode(prompt.context_ids[0, -1:])
    question = tokenizer.decode(prompt.question_ids[0])
    if separator_in_context:  # RULER's layout: haystack, newline | question
        assert last == "\n" and question.startswith(QUESTION)
    else:
        assert last == "." and question.startswith("\n" + QUESTION)
    start = context.index(NEEDLE)
    needle_tokens = prompt.token_positions(tokenizer, [(start, start + len(NEEDLE))])
    assert NEEDLE in tokenizer.decode(prompt.context_ids[0, needle_tokens])
