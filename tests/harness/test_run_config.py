"""What a row's config records about the run: for a grid reading a data file, the file's tasks and lengths."""

import hashlib

from kvsieve.harness.grid import GridConfig
from kvsieve.harness.run import recorded_config
from kvsieve.tasks.load import read_samples
from kvsieve.tasks.sample import Sample, write_jsonl


def _sample(task: str, length: int, sid: str) -> Sample:
    return Sample(id=sid, task=task, context="ctx " * 4, question="q?", answer_prefix="A:", answers=["x"],
                  max_new_tokens=4, length=length, seed=0, metric="string_match_all")


def test_a_data_grid_records_the_files_tasks_lengths_and_digest(tmp_path):
    path = tmp_path / "requests.jsonl"
    write_jsonl([_sample("lmeval:ruler_vt", 4096, "0-a"), _sample("lmeval:niah_single_1", 4096, "0-b"),
                 _sample("lmeval:niah_single_1", 8192, "1-c")], path)
    config = GridConfig(data=str(path), store=str(tmp_path / "s.sqlite"))
    assert config.tasks == ["niah_single_1"] and config.lengths == [1024]  # the generator's defaults, unused here
    out = recorded_config(config, read_samples(str(path)))
    assert out["tasks"] == ["lmeval:niah_single_1", "lmeval:ruler_vt"]
    assert out["lengths"] == [4096, 8192]
    assert out["samples"] == 3
    assert out["data_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert "store" not in out


def test_a_generated_grid_records_its_own_settings(tmp_path):
    config = GridConfig(tasks=["ruler_vt"], lengths=[2048], samples=2, store=str(tmp_path / "s.sqlite"))
    out = recorded_config(config, [])
    assert out["tasks"] == ["ruler_vt"] and out["lengths"] == [2048] and out["samples"] == 2
    assert "data_sha256" not in out
