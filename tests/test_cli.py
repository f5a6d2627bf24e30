"""What a new user hits first (issue 17): clear errors, canonical names, fast help, nothing lost on Ctrl-C."""

import dataclasses
import hashlib
import json
import subprocess
import sys

import pytest

import kvsieve.cli as cli
from kvsieve.cli_arguments import build_parser
from kvsieve.harness.content import check_store
from kvsieve.harness.grid import GridConfig, cells_for
from kvsieve.harness.store import CellKey, CellResult, ResultsStore
from kvsieve.harness.validate import validate
from kvsieve.models import check_length
from kvsieve.policies import parse
from kvsieve.tasks.load import read_samples
from kvsieve.tasks.ruler import generate
from kvsieve.tasks.sample import write_jsonl


def _run(capsys, *argv) -> tuple[int, str]:
    code = cli.main(list(argv))
    return code, capsys.readouterr().err


def test_help_does_not_import_torch():
    # `kvsieve --help` took 6-9 s because the CLI imported torch and transformers at the top
    code = "import sys, kvsieve.cli; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_help_sets_a_passive_openmp_wait_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cli._set_threads(None)
    assert cli.os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    cli._set_threads(3)
    assert cli.os.environ["OMP_WAIT_POLICY"] == "ACTIVE" and cli.os.environ["OMP_NUM_THREADS"] == "3"
    with pytest.raises(ValueError, match="--threads 0"):
        cli._set_threads(0)


@pytest.mark.parametrize("flag,value,message", [
    ("--ratios", "abc", "--ratios 'abc': 'abc' is not a float"),
    ("--lengths", "1k", "--lengths '1k': '1k' is not an int"),
])
def test_a_bad_number_names_its_flag(capsys, flag, value, message):
    code, err = _run(capsys, "eval", flag, value)
    assert code == 2 and message in err


def test_a_broken_config_file_is_named(capsys, tmp_path):
    path = tmp_path / "grid.toml"
    path.write_text('tasks = ["vt"\n')
    code, err = _run(capsys, "eval", "--config", str(path))
    assert code == 2 and f"config file {path}:" in err and "Traceback" not in err


@pytest.mark.parametrize("field,value,expected", [
    ("tasks", "niah_single_1", ["niah_single_1"]),  # was: unknown task(s) 'n', 'i', ...
    ("ratios", 0.5, [0.5]),  # was: 'float' object is not iterable
    ("lengths", 512, [512]),
])
def test_a_single_value_where_a_list_belongs_is_a_list_of_one(field, value, expected):
    config = GridConfig(**{field: value})
    assert getattr(config, field) == expected
    validate(config)


def test_a_config_value_of_the_wrong_kind_is_named(capsys, tmp_path):
    path = tmp_path / "grid.toml"
    path.write_text("[tasks]\nniah = 1\n")
    code, err = _run(capsys, "eval", "--config", str(path))
    assert code == 2 and "tasks must be a list" in err and str(path) in err


def test_eval_flags_set_the_decode_mode_the_cells_are_stored_under():
    """--mode decode --chunk-size 64 --evict-every 16: every compressing cell is SPEC@decode64e16 (what kvsieve serve
    runs for that label), full KV read the same way."""
    args = build_parser().parse_args(["eval", "--policies", "full,tova", "--ratios", "0.5", "--mode", "decode",
                              "--chunk-size", "64", "--evict-every", "16"])
    cells = [cell.stored for cell in cells_for(cli._grid(args))]
    assert cells == ["full@decode64e16", "tova@decode64e16"]


def test_aliases_resolve_to_the_canonical_name_the_store_uses():
    assert GridConfig(model="smollm2-135m").model == "smollm2-135m-instruct"
    assert GridConfig(model="qwen2.5-0.5b").model == "qwen2.5-coder-0.5b-instruct"
    assert GridConfig(model="org/other").model == "org/other"


@pytest.mark.parametrize("length", [100000, 0, "2048"])
def test_one_length_check_for_every_command(length):
    with pytest.raises(ValueError, match="length"):
        check_length("smollm2-135m-instruct", length)
    check_length("smollm2-135m-instruct", 8192)


def test_train_refuses_a_length_beyond_the_model_before_any_work(capsys, tmp_path):
    code, err = _run(capsys, "train", "--model", "smollm2-135m", "--length", "100000", "--out", str(tmp_path / "r"))
    assert code == 2 and "length 100000 is above the context of smollm2-135m" in err


def test_train_passes_network_and_temperature_and_refuses_kvzap_in_decode_mode(capsys, tmp_path):
    code, err = _run(capsys, "train", "--network", "kvzap", "--mode", "decode", "--out", str(tmp_path / "r"))
    assert code == 2 and "network 'kvzap' trains in prefill mode only, not 'decode'" in err
    code, err = _run(capsys, "train", "--temperature", "-1", "--out", str(tmp_path / "r"))
    assert code == 2 and "temperature must be a number > 0, got -1.0" in err


@pytest.mark.parametrize("flags, kind", [((), "learned"), (("--network", "kvzap", "--mode", "prefill"), "kvzap"),
                                         (("--objective", "kvzap"), "kvzap")])
def test_train_says_how_to_evaluate_what_it_trained(capsys, tmp_path, monkeypatch, flags, kind):
    import kvsieve.learn.train as train_module
    from kvsieve.learn.train_config import TrainResult

    out = tmp_path / "r"
    monkeypatch.setattr(train_module, "train", lambda config: TrainResult(
        out, out / "policy.safetensors", out / "checkpoint.safetensors", out / "log.csv", out / "curve.png", 0, []))
    assert cli.main(["train", *flags, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"--policies \"full,{kind}(checkpoint='{out / 'policy.safetensors'}')\"" in printed


def _samples(tmp_path, ids: list[str], spans: bool = True):
    samples = []
    for i, sid in enumerate(ids):
        sample = generate("niah_single_1", 300, i, lambda t: len(t) // 4)
        sample.id = sid
        if not spans:
            sample.spans = []
        samples.append(sample)
    path = tmp_path / "s.jsonl"
    write_jsonl(samples, path)
    return path


def test_duplicate_sample_ids_in_a_data_file_are_refused(tmp_path):
    # two samples under one id shared one store row: 4 cells computed, 2 stored
    path = _samples(tmp_path, ["a", "b", "a"])
    with pytest.raises(ValueError, match=r"unique.*niah_single_1/\d+/'a' x2"):
        read_samples(str(path))


def test_oracle_runs_on_a_data_file_whose_samples_carry_spans(tmp_path):
    validate(GridConfig(data=str(_samples(tmp_path, ["a", "b"])), policies=["full", "oracle"]))
    with pytest.raises(ValueError, match=r"2 sample\(s\) of .* carry none"):
        validate(GridConfig(data=str(_samples(tmp_path, ["a", "b"], spans=False)), policies=["full", "oracle"]))


def test_generate_onto_a_folder_is_a_clear_error(capsys, tmp_path):
    code, err = _run(capsys, "generate", "--tasks", "niah_single_1", "--lengths", "256", "--samples", "1",
                     "--out", str(tmp_path))
    assert code == 2 and "Is a directory" in err and "Traceback" not in err


def test_ctrl_c_says_what_was_kept_without_a_traceback(capsys, monkeypatch, tmp_path):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "report", interrupted)
    code, err = _run(capsys, "report", "--store", str(tmp_path / "x.sqlite"))
    assert code == 130 and "interrupted" in err and "rerun the same command to resume" in err


def test_a_file_that_is_not_sqlite_is_a_clear_error(capsys, tmp_path):
    path = tmp_path / "notes.sqlite"
    path.write_text("this is not a database\n" * 100)
    code, err = _run(capsys, "report", "--store", str(path))
    assert code == 2 and "Traceback" not in err and str(path) in err or "not a kvsieve SQLite file" in err


def test_report_pools_several_stores_and_names_a_missing_one(capsys, tmp_path):
    paths = []
    for name, sample, score in (("a", "s0", 100.0), ("b", "s1", 0.0)):
        with ResultsStore(tmp_path / f"{name}.sqlite") as store:
            store.add_many([CellResult(CellKey("m", "vt", 512, sample, "full", 0.0, False), "x", score, ["y"], 1, 2,
                                       2, 1.0, 0.0, {})])
        paths.append(str(tmp_path / f"{name}.sqlite"))
    assert cli.main(["report", "--headline", "--store", *paths]) == 0
    out = capsys.readouterr().out
    assert "### m at 512 tokens: 2 requests" in out and "| full | 0 | 50.0 |" in out  # (100 + 0) / 2
    code, err = _run(capsys, "report", "--headline", "--store", paths[0], str(tmp_path / "missing.sqlite"))
    assert code == 2 and "missing.sqlite does not exist" in err


def _row(policy: str, digest: str | None) -> CellResult:
    key = CellKey("m", "vt", 512, "s0", policy, 0.5, False)
    return CellResult(key, "x", 0.0, ["y"], 1, 1, 2, 0.0, 0.0, {"policy_digest": digest} if digest else {})


def test_program_rows_are_keyed_by_the_file_contents(tmp_path):
    program = tmp_path / "best.py"
    program.write_text("SELECTION = {}\n\ndef score(f):\n    return f.key_norm\n")
    spec = f"program:{program}"
    digest = parse(spec).digest
    assert digest == hashlib.sha256(program.read_bytes()).hexdigest()
    assert parse("snapkv(window=8)").digest is None
    with ResultsStore(tmp_path / "r.sqlite") as store:
        store.add(_row(spec, digest))
        check_store(store, "m", {spec: digest})  # same bytes: the rows are reused
        program.write_text("SELECTION = {'chunk_size': 4}\n\ndef score(f):\n    return f.key_norm\n")
        with pytest.raises(ValueError, match=r"computed from other file contents.*another --store"):
            check_store(store, "m", {spec: parse(spec).digest})
        store.add(_row("program:old.py", None))  # rows from before digests were recorded
        with pytest.raises(ValueError, match="unrecorded"):
            check_store(store, "m", {"program:old.py": "f" * 64})


def test_learned_rows_are_keyed_by_the_checkpoint_bytes():
    from kvsieve.networks.shipped import resolve_checkpoint

    spec = "learned(checkpoint='smollm2-135m-instruct')"
    path = resolve_checkpoint("learned", "smollm2-135m-instruct")
    assert parse(spec).digest == hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_program_reading_the_surrogate_is_keyed_by_the_surrogate_bytes_too(tmp_path):
    """Rows of a program reading f.surrogate depend on the surrogate's weights as much as on the program."""
    from kvsieve.networks.shipped import CHECKPOINT_DIR, SHIPPED

    def sha(path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    program = tmp_path / "best.py"
    program.write_text('SELECTION = {"allocation": "global", "normalization": "none"}\n\n\n'
                       "def score(f):\n    return f.surrogate\n")
    weights = tmp_path / "kvzap.safetensors"
    weights.write_bytes(b"first weights")
    named = f"program(path='{program}', surrogate='{weights}')"
    digest = parse(named).digest
    assert digest == hashlib.sha256((sha(program) + sha(weights)).encode()).hexdigest()
    weights.write_bytes(b"retrained weights")
    assert parse(named).digest != digest  # same program, another surrogate: not the same rows
    # none named: the harness binds the model's shipped surrogate, so every shipped one counts
    shipped = [CHECKPOINT_DIR / SHIPPED[kind, name] for kind, name in sorted(SHIPPED) if kind == "kvzap"]
    assert all(p.is_file() for p in shipped)
    expected = hashlib.sha256("".join([sha(program), *map(sha, shipped)]).encode()).hexdigest()
    assert parse(f"program:{program}").digest == expected
    program.write_text("def score(f):\n    return f.key_norm\n")  # reads no surrogate: the file alone
    assert parse(named).digest == parse(f"program:{program}").digest == sha(program)
    with pytest.raises(ValueError, match="does not exist"):
        parse(f"program:{tmp_path / 'missing.py'}")

def test_rows_record_the_dtype_the_model_computed_in(tmp_path):
    import torch
    from conftest import CharTokenizer, tiny_model

    from kvsieve.harness.executor import LocalGridExecutor
    from kvsieve.harness.run import run_grid

    config = GridConfig(model="tiny", tasks=["niah_single_1"], lengths=[480], policies=["full", "knorm"],
                        ratios=[0.5], samples=1, store=str(tmp_path / "r.sqlite"))
    executor = LocalGridExecutor(factory=lambda: (tiny_model("llama"), CharTokenizer()))
    with run_grid(config, progress=False, executor=executor) as store:
        rows = store.rows()
    assert {r.config["dtype"] for r in rows} == {"float32"}  # not the config's "auto"
    assert json.dumps(rows[0].config)  # stays JSON

    # resuming on a machine where "auto" picks bfloat16 would pair its rows with the float32 ones
    more = dataclasses.replace(config, samples=2)
    def bf16_model():
        return tiny_model("llama").to(torch.bfloat16), CharTokenizer()

    with pytest.raises(ValueError, match=r"computed in float32, and this run computes in bfloat16.*--dtype float32"):
        run_grid(more, progress=False, executor=LocalGridExecutor(factory=bf16_model))
    with ResultsStore(config.store) as store:
        assert store.count() == len(rows)  # refused before any row of the second sample landed
        assert store.dtypes(model="tiny") == {"float32"} and store.dtypes(model="other") == set()
    with run_grid(more, progress=False, executor=LocalGridExecutor(factory=executor.factory)) as store:
        assert store.count() == 2 * len(rows)  # the same dtype resumes


def test_the_grid_refuses_a_learned_checkpoint_on_another_model_of_its_geometry():
    # the shipped SmolLM2 checkpoint used to run on any random 30-layer Llama with 3 KV heads of 64 dims
    import torch
    from conftest import CharTokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig

    from kvsieve.harness.evaluate import evaluate_sample
    from kvsieve.policies.label import Point

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=576, intermediate_size=64, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=1024)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    sample = generate("niah_single_1", 480, 0, lambda t: len(t))
    cells = [Point("learned(checkpoint='smollm2-135m-instruct')", 0.5)]
    for name in ("", "smollm2-135m-instruct"):
        with pytest.raises(ValueError, match="was trained for model 'smollm2-135m-instruct'"):
            evaluate_sample(model, CharTokenizer(), sample, cells, name)


def test_a_grid_reads_the_second_layout_beside_the_first():
    # fmt2: tasks come from tasks/ruler_alt.py, written apart from ruler.py, so no policy is tuned to one layout
    from conftest import CharTokenizer

    from kvsieve.tasks import task_family
    from kvsieve.tasks.load import load_samples

    config = GridConfig(tasks=["niah_single_1", "fmt2:niah_single_1"], lengths=[480], samples=1,
                        policies=["full"])
    validate(config)
    samples = list(load_samples(config.sample_spec(), CharTokenizer()))
    assert [s.task for s in samples] == ["niah_single_1", "fmt2:niah_single_1"]
    first, second = samples
    assert second.answer_prefix.startswith(" ") and second.context.endswith("\n")
    assert first.question != second.question or first.context != second.context
    assert task_family("fmt2:niah_single_1") == task_family("niah_single_1") == "retrieval"
    with pytest.raises(ValueError, match="unknown task.*'fmt3:vt'.*fmt2:niah_single_1"):
        validate(GridConfig(tasks=["fmt3:vt"], lengths=[480], policies=["full"]))


def test_a_spec_is_parsed_once_per_run(monkeypatch, tmp_path):
    # issue 19: the spec text used to be parsed five times in four files; now once, when the grid is made
    from conftest import CharTokenizer, tiny_model

    import kvsieve.harness.grid as grid_module
    import kvsieve.policies.registry as registry
    from kvsieve.harness.executor import LocalGridExecutor
    from kvsieve.harness.run import run_grid

    calls: list[str] = []
    real = registry.parse

    def counting(text: str):
        calls.append(text)
        return real(text)

    monkeypatch.setattr(registry, "parse", counting)
    monkeypatch.setattr(grid_module, "parse", counting)
    config = GridConfig(model="tiny", tasks=["niah_single_1"], lengths=[480], samples=2,
                        policies=["full", "knorm", "snapkv(window=8)"], qa_policies=["oracle"], ratios=[0.5, 0.75],
                        store=str(tmp_path / "r.sqlite"))
    executor = LocalGridExecutor(factory=lambda: (tiny_model("llama"), CharTokenizer()))
    with run_grid(config, progress=False, executor=executor) as store:
        assert store.count() == 2 * (1 + 2 * 3)
    assert sorted(calls) == sorted(["full", "knorm", "snapkv(window=8)", "oracle"])


def test_the_learned_policy_can_spend_its_budget_across_the_model():
    # issue 21: allocation in every search; the shipped network's logits are standardised per head first
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import kvsieve
    from kvsieve.engine.cache import sieve_layers
    from kvsieve.policies import from_spec

    policy = from_spec("learned(checkpoint='smollm2-135m-instruct', allocation='global')")
    assert (policy.selection.allocation, policy.selection.normalization) == ("global", "zscore")
    with pytest.raises(ValueError, match="allocation 'everywhere' is not one of"):
        from_spec("learned(checkpoint='smollm2-135m-instruct', allocation='everywhere')")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=576, intermediate_size=64, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=1024)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with kvsieve.attach(model, policy, ratio=0.5):
        cache = model(input_ids=torch.randint(0, 128, (1, 300)), use_cache=True).past_key_values
    lengths = [n for _, layer in sieve_layers(cache) for n in layer.head_lengths]
    assert sum(lengths) == 150 * len(lengths) and len(set(lengths)) > 1
