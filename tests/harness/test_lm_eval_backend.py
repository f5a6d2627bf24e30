"""kvsieve inside lm-eval: the ``kvsieve`` backend end to end through lm-eval's own
``simple_evaluate`` on a tiny random model and a tiny task (skipped where lm-eval is not installed); one run of
lm-eval's RULER niah_single_1 on the bundled SmolLM2 (``model``)."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("lm_eval")

import lm_eval  # noqa: E402
from conftest import tiny_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from tokenizers import Tokenizer, decoders, models  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from kvsieve.harness.headline_tables import headline  # noqa: E402
from kvsieve.harness.lm_eval_backend import KvsieveLM, _with_tokenizer  # noqa: E402
from kvsieve.harness.lm_eval_export import TASK_PREFIX, export_samples, length_lines  # noqa: E402
from kvsieve.harness.store import ResultsStore  # noqa: E402
from kvsieve.tasks.sample import Sample, read_jsonl  # noqa: E402


def test_cli_arguments_gain_the_bundled_models_tokenizer_folder(monkeypatch):
    import kvsieve.harness.lm_eval_backend as backend

    monkeypatch.setattr(backend, "local_source", lambda name: f"/cache/{name}")
    argv = ["lm_eval", "--model", "kvsieve", "--model_args", "model=smollm2-135m,policy=kvzip,ratio=0.5"]
    assert _with_tokenizer(argv)[-1] == ("model=smollm2-135m,policy=kvzip,ratio=0.5,"
                                         "tokenizer=/cache/smollm2-135m-instruct")
    given = ["lm_eval", "--model_args=model=m,tokenizer=/mine"]
    assert _with_tokenizer(given) == given


# -- the backend through lm-eval --------------------------------------------------------------------------------


def char_tokenizer(folder) -> None:
    """A character-level HF tokenizer (ids 32-126, one per printable ASCII character) with a toy chat template."""
    vocab = {"<unk>": 0, "\n": 10, **{chr(i): i for i in range(32, 127)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
                          "{% if add_generation_prompt %}A:{% endif %}")
    fast.save_pretrained(folder)


TASK_YAML = """
task: kvs_tiny
dataset_path: ""
dataset_name: ""
output_type: generate_until
test_split: test
custom_dataset: !function tiny_utils.docs
doc_to_text: "{{input}}"
doc_to_target: "{{outputs}}"
gen_prefix: "{{gen_prefix}}"
target_delimiter: " "
process_results: !function tiny_utils.process_results
metric_list:
  - metric: match
    aggregation: mean
    higher_is_better: true
generation_kwargs:
  do_sample: false
  max_gen_toks: 4
  until: []
metadata:
  version: 1.0
"""

TASK_UTILS = '''
import datasets

def docs(**kwargs):
    rows = [{"input": "Remember: the code for door %d is %d.\\nfiller text " % (i, 70 + i) * 3
                      + "\\nWhat is the code for door %d?" % i,
             "outputs": [str(70 + i)], "gen_prefix": "The code is", "max_length": 128} for i in range(3)]
    rows.append({"input": "one line only, no question line at all " * 3, "outputs": ["x"], "gen_prefix": "",
                 "max_length": 128})
    return {"test": datasets.Dataset.from_list(rows)}

def process_results(doc, results):
    return {"match": float(any(o in results[0] for o in doc["outputs"]))}
'''


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lmeval")
    model_dir = root / "tiny-llama"
    tiny_model("llama").save_pretrained(model_dir)
    char_tokenizer(model_dir)
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "kvs_tiny.yaml").write_text(textwrap.dedent(TASK_YAML))
    (tasks / "tiny_utils.py").write_text(TASK_UTILS)
    return model_dir, tasks, TaskManager(include_path=str(tasks))  # one index of lm-eval's tasks (~12 s) for all


def run(setup, policy: str, ratio: float, store, **extra) -> dict:
    model_dir, _, manager = setup
    args = {"model": str(model_dir), "policy": policy, "ratio": ratio, "store": str(store), "dtype": "float32", **extra}
    return lm_eval.simple_evaluate(model="kvsieve", model_args=args, tasks=["kvs_tiny"], task_manager=manager,
                                   log_samples=True)


def test_backend_answers_lm_eval_requests_compressed_and_stores_rows(tiny_setup, tmp_path):
    store = tmp_path / "lmeval.sqlite"
    full = run(tiny_setup, "full", 0.0, store)
    tova = run(tiny_setup, "tova", 0.5, store)
    assert "kvs_tiny" in full["results"] and "match,none" in tova["results"]["kvs_tiny"]
    with ResultsStore(store) as s:
        rows = s.rows()
    # 3 RULER-shaped documents and one without a question line, under both policies
    assert len(rows) == 8 and {r.key.task for r in rows} == {TASK_PREFIX + "kvs_tiny"}
    by = {(r.key.policy, r.key.sample_id): r for r in rows}
    one_line = [r for r in rows if r.config["lm_eval"]["split"] != "last line"]
    assert {(r.key.policy, r.key.question_aware) for r in one_line} == {("full", False), ("tova", True)}
    compressed = [r for r in rows if r.key.policy == "tova"]
    assert all(r.cache_bytes < r.cache_bytes_full for r in compressed)  # the cache really was pruned
    assert all(r.key.length == 128 and r.provenance["machine"] for r in rows)
    # lm-eval received exactly what the store holds (the answer after the answer prefix)
    for sample in tova["samples"]["kvs_tiny"]:
        prediction = sample["resps"][0][0]
        assert any(r.prediction == prediction for (p, _), r in by.items() if p == "tova")
    # the rows pair in kvsieve's headline: tova (query-agnostic) and tova+qa (the one-line document)
    (table,) = headline(rows, resamples=50)
    assert {(r.policy, r.n) for r in table.rows} == {("full", 4), ("tova", 3), ("tova+qa", 1)}


def test_exported_samples_carry_the_backends_row_keys(tiny_setup, tmp_path):
    model_dir, tasks, _ = tiny_setup
    store = tmp_path / "lmeval.sqlite"
    run(tiny_setup, "full", 0.0, store)
    out = tmp_path / "samples.jsonl"
    assert export_samples(str(model_dir), ["kvs_tiny"], [128], 3, out, include_path=str(tasks)) == 3
    samples = read_jsonl(out)
    with ResultsStore(store) as s:
        stored = {(r.key.task, r.key.length, r.key.sample_id) for r in s.rows()}
    # kvsieve eval --data on this file fills the very rows the backend reuses
    assert {(x.task, x.length, x.id) for x in samples} <= stored
    assert all(x.question.startswith("What is the code") and x.answer_prefix == "The code is" for x in samples)
    with pytest.raises(ValueError, match="through the backend"):  # the fourth document has no question line
        export_samples(str(model_dir), ["kvs_tiny"], [128], 4, tmp_path / "all.jsonl", include_path=str(tasks))


def test_an_export_after_skip_is_the_rest_of_a_longer_export(tiny_setup, tmp_path):
    model_dir, tasks, _ = tiny_setup
    longer, fresh = tmp_path / "longer.jsonl", tmp_path / "fresh.jsonl"
    export_samples(str(model_dir), ["kvs_tiny"], [128], 3, longer, include_path=str(tasks))
    assert export_samples(str(model_dir), ["kvs_tiny"], [128], 2, fresh, include_path=str(tasks), skip=1) == 2
    assert [s.id for s in read_jsonl(fresh)] == [s.id for s in read_jsonl(longer)][1:]
    with pytest.raises(ValueError, match="skip=-1"):
        export_samples(str(model_dir), ["kvs_tiny"], [128], 2, fresh, include_path=str(tasks), skip=-1)


def test_export_names_requests_far_below_their_nominal_length():
    def sample(task: str, words: int, length: int = 100) -> Sample:
        return Sample(f"{task}-{words}", task, "w " * (words - 1), "q", "", ["a"], 8, length, 0, "string_match_all")

    # counted by words: 74 of a nominal 100 is under 75%, 75 is not; each task's range over its own requests
    samples = [sample("a", 98), sample("b", 74), sample("a", 80), sample("b", 75), sample("b", 30, length=40)]
    assert length_lines(samples, lambda text: len(text.split())) == [
        "a: 80-98 tokens (context + question)",
        "b: 30-75 tokens (context + question); 1 of 3 under 75% of their nominal length",
    ]


def test_a_rerun_reuses_the_stored_rows(tiny_setup, tmp_path, monkeypatch):
    store = tmp_path / "lmeval.sqlite"
    first = run(tiny_setup, "knorm", 0.5, store)
    import kvsieve.harness.lm_eval_backend as backend

    def refuse(*args, **kwargs):
        raise AssertionError("a stored prompt was computed again")

    monkeypatch.setattr(backend, "evaluate_sample", refuse)
    again = run(tiny_setup, "knorm", 0.5, store)
    assert [s["resps"] for s in again["samples"]["kvs_tiny"]] == [s["resps"] for s in first["samples"]["kvs_tiny"]]


def test_backend_refuses_chat_templates_loglikelihood_and_unknown_arguments(tiny_setup, tmp_path):
    model_dir, _, _ = tiny_setup
    lm = KvsieveLM(model=str(model_dir), policy="tova", ratio=0.5, store="none", dtype="float32")
    with pytest.raises(ValueError, match="apply_chat_template"):
        lm.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(NotImplementedError):
        lm.loglikelihood([])
    with pytest.raises(ValueError, match="unknown model_args pretrained"):
        KvsieveLM(model=str(model_dir), pretrained="x")
    with pytest.raises(ValueError, match="unknown policy"):
        KvsieveLM(model=str(model_dir), policy="nope")


@pytest.mark.model
def test_ruler_niah_on_smollm2_through_lm_eval(tmp_path):
    from kvsieve.harness.lm_eval_backend import evaluate

    store = tmp_path / "lmeval.sqlite"
    full = evaluate("smollm2-135m-instruct", ["niah_single_1"], "full", 0.0, lengths=[1024], limit=2, store=str(store),
                    threads=1)
    kept = evaluate("smollm2-135m-instruct", ["niah_single_1"], "kvzip", 0.5, lengths=[1024], limit=2,
                    store=str(store), threads=1)
    assert full["results"]["niah_single_1"]["1024,none"] >= 0.5  # SmolLM2 finds single needles at 1k
    assert "1024,none" in kept["results"]["niah_single_1"]
    with ResultsStore(store) as s:
        rows = s.rows()
    assert {(r.key.policy, r.key.question_aware) for r in rows} == {("full", False), ("kvzip", False)}
    assert all(r.key.length == 1024 and r.config["lm_eval"]["split"] == "last line" for r in rows)
    # the store's scores are lm-eval's own per-request metric (x100)
    assert sum(r.score for r in rows if r.key.policy == "full") / 2 == pytest.approx(
        100 * full["results"]["niah_single_1"]["1024,none"])


@pytest.mark.model
def test_ruler_export_is_the_same_whatever_the_task_list_and_limit(tmp_path):
    # RULER's generators draw from the global generators (and importing them draws too): unseeded, two exports
    # of one task differ, and a task's samples depend on the tasks listed before it
    def ids(tasks, limit, name):
        out = tmp_path / f"{name}.jsonl"
        export_samples("smollm2-135m-instruct", tasks, [1024], limit, out)
        return {(s.task, s.id, tuple(s.answers)) for s in read_jsonl(out)}

    alone = ids(["ruler_fwe"], 2, "alone")
    after = ids(["niah_single_1", "ruler_fwe"], 3, "after")
    assert len(alone) == 2 and alone <= after
    assert ids(["niah_single_1"], 1, "first") <= after
