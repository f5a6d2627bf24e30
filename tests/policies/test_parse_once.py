"""A program or checkpoint file is parsed or loaded once per process, however many policies a spec builds (every cell
of a grid builds its own), and read again when the file changes; policies sharing a network cannot move it for
each other."""

from __future__ import annotations

import os
from collections import OrderedDict

import pytest
import torch
from conftest import random_kvzap

import kvsieve.policies.kvzap as kvzap_module
import kvsieve.policies.learned as learned_module
import kvsieve.policies.program as program_module
from kvsieve.networks.checkpoint import save_checkpoint
from kvsieve.networks.keep_net import KeepNet
from kvsieve.networks.model_shape import ModelShape
from kvsieve.policies import parse
from kvsieve.policies.kvzap import KVzap
from kvsieve.policies.learned import LearnedPolicy

PROGRAM = 'SELECTION = {{"sink": {sink}}}\n\n\ndef score(f):\n    return f.key_norm\n'


def counting(monkeypatch, module, name: str) -> list:
    """Replace ``module.name`` by a wrapper that records each call."""
    calls, real = [], getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def touch(path, step: int) -> None:
    """A new modification time, whatever the file system's clock resolution."""
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + step * 1_000_000_000))


def test_a_program_file_is_parsed_once_and_again_when_it_changes(monkeypatch, tmp_path):
    monkeypatch.setattr(program_module, "_PARSED", OrderedDict())
    parses = counting(monkeypatch, program_module, "ScoreProgram")
    path = tmp_path / "best.py"
    path.write_text(PROGRAM.format(sink=2))
    spec = parse(f"program:{path}")  # reads whether the program reads f.surrogate: the one parse
    first, second = spec.build(), spec.build()
    assert len(parses) == 1
    assert first is not second and first.program is second.program and first._score is not second._score
    assert first._score.graph is second._score.graph  # the typed graph is shared; the callable, limits and cost are not
    strict = parse(f"program(path='{path}', deadline_s=0.5)").build()
    assert len(parses) == 1 and strict._score.limits.deadline_s == 0.5 != first._score.limits.deadline_s
    assert first.selection.sink == 2
    path.write_text(PROGRAM.format(sink=6))  # the file changed: its new text is parsed
    changed = parse(f"program:{path}").build()
    assert len(parses) == 2 and changed.selection.sink == 6 and first.selection.sink == 2
    parse(f"program:{path}").build()
    assert len(parses) == 2


def test_a_bad_program_is_refused_every_time(monkeypatch, tmp_path):
    monkeypatch.setattr(program_module, "_PARSED", OrderedDict())
    path = tmp_path / "bad.py"
    path.write_text("import os\n\n\ndef score(f):\n    return f.key_norm\n")
    for _ in range(2):  # errors are not cached: each build names the file and the problem
        with pytest.raises(ValueError, match=str(path)):
            program_module.ProgramPolicy(path=str(path))


def test_a_kvzap_checkpoint_is_loaded_once_and_again_when_it_changes(monkeypatch, tmp_path, llama):
    monkeypatch.setattr(kvzap_module, "_LOADED", {})
    loads = counting(monkeypatch, kvzap_module, "load_kvzap")
    path = random_kvzap(llama, tmp_path / "kvzap.safetensors")
    spec = parse(f"kvzap(checkpoint='{path}')")
    first, second = spec.build(), spec.build()
    assert len(loads) == 1 and first.net is second.net
    first.meta["header"] = -1  # each policy holds its own metadata
    assert second.meta["header"] == 3 and KVzap(checkpoint=str(path)).header == 3
    random_kvzap(llama, path, seed=1)  # rewritten in place
    touch(path, 1)
    changed = spec.build()
    assert len(loads) == 2 and changed.net is not first.net
    assert not torch.equal(changed.net.linear_weight, first.net.linear_weight)
    spec.build()
    assert len(loads) == 2


def test_a_policy_on_another_device_moves_a_copy_of_the_shared_network(monkeypatch, tmp_path, llama):
    monkeypatch.setattr(kvzap_module, "_LOADED", {})
    path = random_kvzap(llama, tmp_path / "kvzap.safetensors")
    moved, stays = KVzap(checkpoint=str(path)), KVzap(checkpoint=str(path))
    shared = stays.net
    assert moved.net is shared
    moved._follow_device(torch.device("meta"))  # what --device cuda does, without a GPU
    assert moved.net is not shared and moved.net.linear_weight.device.type == "meta"
    assert stays.net is shared and shared.linear_weight.device.type == "cpu"
    assert KVzap(checkpoint=str(path)).net is shared  # the cache still holds the CPU network
    # a live network (training) is this policy's alone: it moves in place, as before
    live = KVzap.from_network(stays.net.__class__(stays.net.config), dict(stays.meta))
    net = live.net
    live._follow_device(torch.device("meta"))
    assert live.net is net and net.linear_weight.device.type == "meta"


def test_a_learned_checkpoint_is_loaded_once_and_again_when_it_changes(monkeypatch, tmp_path, llama):
    monkeypatch.setattr(learned_module, "_LOADED", {})
    loads = counting(monkeypatch, learned_module, "load_checkpoint")
    path = tmp_path / "policy.safetensors"

    def save(seed: int) -> KeepNet:
        torch.manual_seed(seed)
        net = KeepNet()
        meta = {"model": ModelShape.of(llama, "tiny-llama").to_dict(), "net": net.config.to_dict(), "window": 4}
        save_checkpoint(path, meta, {f"net.{k}": v for k, v in net.state_dict().items()})
        return net

    save(0)
    spec = parse(f"learned(checkpoint='{path}')")
    first, second = spec.build(), spec.build()
    assert len(loads) == 1 and first.net is second.net and first.window == 4
    rewritten = save(1)
    touch(path, 1)
    changed = spec.build()
    assert len(loads) == 2 and changed.net is not first.net
    new, old = changed.net.state_dict(), first.net.state_dict()
    assert all(torch.equal(value, rewritten.state_dict()[name]) for name, value in new.items())
    assert not all(torch.equal(value, old[name]) for name, value in new.items())
    LearnedPolicy(checkpoint=str(path))
    assert len(loads) == 2
