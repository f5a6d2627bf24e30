"""Where models run: ``--device`` / ``$KVSIEVE_DEVICE``, checked before any load; dtype auto follows the device."""

import pytest
import torch

from kvsieve.cli import main
from kvsieve.models import auto_dtype, resolve_device, resolve_dtype


def test_device_defaults_to_the_cpu_and_follows_the_environment(monkeypatch):
    monkeypatch.delenv("KVSIEVE_DEVICE", raising=False)
    assert resolve_device() == torch.device("cpu")
    monkeypatch.setenv("KVSIEVE_DEVICE", "cpu")
    assert resolve_device() == torch.device("cpu")
    assert resolve_dtype("auto", "cpu") == auto_dtype("cpu")[0]


@pytest.mark.parametrize("bad, message", [("gpu", "not a torch device"), ("mps", "not supported"),
                                          ("cuda:0", "no CUDA GPU")])
def test_a_device_this_machine_cannot_use_is_refused_by_name(bad, message, monkeypatch):
    if bad.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match=message) as err:
        resolve_device(bad)
    assert repr(bad) in str(err.value)
    monkeypatch.setenv("KVSIEVE_DEVICE", bad)
    with pytest.raises(ValueError, match=message):
        resolve_dtype("auto")


def test_cli_device_flag_reaches_the_loader(monkeypatch, capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.setenv("KVSIEVE_DEVICE", "cpu")  # restored after the test: main() sets it for the process
    code = main(["--device", "cuda", "generate", "--model", "smollm2-135m-instruct", "--tasks", "niah_single_1",
                 "--lengths", "512", "--out", str(tmp_path / "s.jsonl")])
    assert code == 2 and "no CUDA GPU" in capsys.readouterr().err
