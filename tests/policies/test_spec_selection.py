"""Selection in the spec: any family's scores under another allocation or chunking, spelled in text."""

import hashlib

import pytest
import torch
from conftest import tiny_model

import kvsieve
from kvsieve.engine.cache import sieve_layers
from kvsieve.networks.shipped import resolve_checkpoint
from kvsieve.policies import get
from kvsieve.policies.program import ProgramPolicy, program_spec
from kvsieve.policies.registry import parse
from kvsieve.policies.tova import TOVA
from kvsieve.selection import Selection


def kept_positions(model, policy, ids, ratio):
    with kvsieve.attach(model, policy, ratio=ratio):
        cache = model(input_ids=ids, use_cache=True).cache
    out = []
    for _, layer in sieve_layers(cache):
        heads = layer.heads if layer.is_ragged else None
        out.append([sorted(h.positions[0][h.valid[0] if h.valid is not None else slice(None)].tolist())
                    for h in heads] if heads else [sorted(p.tolist()) for p in layer.positions[0]])
    return out


@torch.no_grad()
def test_a_spec_composes_tova_with_adakvs_allocation_as_the_python_construction_does():
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 96), generator=torch.Generator().manual_seed(0))
    by_text = parse("tova(allocation='layer', window=8)").build()
    by_hand = TOVA(window=8, selection=Selection(allocation="layer"))
    assert by_text.selection == by_hand.selection
    a, b = kept_positions(model, by_text, ids, 0.5), kept_positions(model, by_hand, ids, 0.5)
    assert a == b
    assert get("tova", allocation="layer", window=8).selection == by_hand.selection
    # TOVA's scores are one per entry for the whole layer (averaged over heads); KNorm's are per head, so under
    # the layer's allocation its heads end up at different lengths, stored ragged
    per_head = kept_positions(model, parse("knorm(allocation='layer')").build(), ids, 0.5)
    assert any(len({len(h) for h in layer}) > 1 for layer in per_head)


@torch.no_grad()
def test_a_spec_chunks_knorm_into_whole_chunks():
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 96), generator=torch.Generator().manual_seed(1))
    for layer in kept_positions(model, parse("knorm(chunk_size=8)").build(), ids, 0.5):
        for head in layer:
            starts = {p - p % 8 for p in head}
            assert all(all(s + i in head for i in range(8)) for s in starts)  # every chunk kept whole


@pytest.mark.parametrize("text, message", [
    ("tova(allocation='cone')", "allocation 'cone' is not one of"),
    ("tova(bogus=1)", "unknown 'bogus'.*the selection's.*chunk_size"),
    ("snapkv(allocation='global')", "comparable across layers"),
])
def test_a_bad_selection_in_a_spec_is_refused_by_name(text, message):
    with pytest.raises(ValueError, match=message):
        parse(text).build()


@torch.no_grad()
@pytest.mark.parametrize("name, spec", [
    ("adakv", "snapkv(allocation='layer', adaptive_floor=0.2)"),
    ("pyramidkv", "snapkv(layer_budgets='pyramid', pyramid_beta=20.0)"),
])
def test_adakv_and_pyramidkv_are_snapkv_under_another_selection(name, spec):
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 96), generator=torch.Generator().manual_seed(2))
    named, composed = get(name, window=8), parse(spec.replace(")", ", window=8)")).build()
    assert named.selection == composed.selection
    assert kept_positions(model, named, ids, 0.5) == kept_positions(model, composed, ids, 0.5)
    assert kept_positions(model, named, ids, 0.5) != kept_positions(model, get("snapkv", window=8), ids, 0.5)


def test_a_program_spec_builds_the_program_over_the_surrogate_it_names(tmp_path):
    """What `kvsieve evolve` and `kvsieve pick` print to evaluate a program is a spec the registry builds."""
    program = tmp_path / "best.py"
    program.write_text('SELECTION = {"allocation": "global", "normalization": "none"}\n\n\n'
                       "def score(f):\n    return f.surrogate\n")
    named = parse(program_spec(program, "smollm2-135m-instruct"))
    assert named.family == "program" and named.params == {"path": str(program), "surrogate": "smollm2-135m-instruct"}
    built = named.build()
    assert isinstance(built, ProgramPolicy) and built.path == str(program) and built.surrogate is not None
    checkpoint = resolve_checkpoint("kvzap", "smollm2-135m-instruct")
    assert named.digest == hashlib.sha256((sha256(program) + sha256(checkpoint)).encode()).hexdigest()
    plain = parse(program_spec(program)).build()
    assert isinstance(plain, ProgramPolicy) and plain.path == str(program) and plain.surrogate is None
    quoted = tmp_path / "it's" / "best.py"
    quoted.parent.mkdir()
    quoted.write_bytes(program.read_bytes())
    assert parse(program_spec(quoted, "smollm2-135m-instruct")).params["path"] == str(quoted)


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
