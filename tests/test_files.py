"""kvsieve.files: a file is replaced whole, and two writers of the same file never share a temporary file."""

import pytest
import torch
from safetensors.torch import load_file

from kvsieve.files import save_safetensors, written_whole


def test_two_writers_of_one_file_both_finish(tmp_path):
    # two evolution runs sharing a dev-cache folder write the same features file at once: with one fixed
    # temporary name the second rename found nothing to rename (FileNotFoundError) and stopped its run
    target = tmp_path / "features.safetensors"
    with written_whole(target) as first:
        with written_whole(target) as second:
            assert first != second
            second.write_bytes(b"second")
        assert target.read_bytes() == b"second"
        first.write_bytes(b"first")
    assert target.read_bytes() == b"first"  # the last rename wins
    assert [p.name for p in tmp_path.iterdir()] == ["features.safetensors"]  # no temporary file left behind


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "sub" / "checkpoint.safetensors"  # the folder is created
    save_safetensors({"w": torch.arange(3.0)}, target, metadata={"k": "old"})
    with pytest.raises(RuntimeError, match="interrupted"):
        with written_whole(target) as tmp:
            tmp.write_bytes(b"half a fi")
            raise RuntimeError("interrupted")
    assert torch.equal(load_file(target)["w"], torch.arange(3.0))
    assert [p.name for p in target.parent.iterdir()] == ["checkpoint.safetensors"]


def test_the_file_gets_the_permissions_a_plain_write_gives(tmp_path):
    # a contract or an assembled model file is read by other users like any file the writer creates
    plain = tmp_path / "plain"
    plain.write_bytes(b"x")
    with written_whole(tmp_path / "contract.json") as tmp:
        tmp.write_text("{}")
    assert (tmp_path / "contract.json").stat().st_mode == plain.stat().st_mode
