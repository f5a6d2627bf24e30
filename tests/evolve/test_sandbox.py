"""Stage 0 (static check), stage 1 (invariants), the interpreter and the sandbox against hostile candidates.

The hostile corpus (``CORPUS``) runs every case against each layer alone and against both together,
asserting the specific reason each layer gives; this process carries on throughout.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from kvsieve.evolve import sandbox
from kvsieve.evolve.sandbox import (
    ISOLATION_LEVELS,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    isolation_level,
    run_in_sandbox,
    sandbox_env,
)
from kvsieve.evolve.seeds import SEEDS
from kvsieve.evolve.stage1_invariants import INVARIANTS, check_invariants
from kvsieve.language.interpreter import InterpreterError, LimitExceeded, ScoreProgram, WallClockExceeded
from kvsieve.language.program_features import load_features, save_features, synthetic_features
from kvsieve.language.program_source import Program
from kvsieve.language.static_check import StaticCheckError, check_source
from kvsieve.policies.program import ProgramPolicy
from kvsieve.selection import Selection
from kvsieve.signals import Signals

WINDOW = 8
BENIGN = "def score(f):\n    return pool(group_mean(f.attn), 5)\n"
RICH = '''"""Touches most of the language, to show the guards leave it working."""
SELECTION = {"chunk_size": 2, "sink": 1}


def score(f):
    a = group_mean(f.attn)
    m = group_max(f.last_attn)
    x = torch.maximum(a, 0.5 * a) + 0.1 * max_pool(m, 3)
    z = torch.sigmoid(x) + rank(f.key_norm) + normalize(f.value_norm) + torch.log1p(group_mean(f.attn))
    v = torch.clamp(unit_mean(a), -1.0, 1.0) ** 2 + torch.sqrt(torch.abs(pool(a, 9))) - torch.tanh(f.surrogate)
    return z + v + f.position * f.layer + f.n * 0.0
'''
# Reaches the os module's globals without a single allowed name: the classic restricted-builtins escape.
OS = '[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == "_wrap_close"][0].__init__.__globals__'
FAST = SandboxLimits(timeout_s=20.0, memory_mb=2048)


@pytest.fixture(scope="module")
def features_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("features") / "features.safetensors"
    save_features(path, {"s0-l0": synthetic_features(5, group=3, n=90, window=WINDOW),
                         "s0-l1": synthetic_features(6, group=3, n=90, window=WINDOW, layer=1.0)})
    return path


def body(*lines: str) -> str:
    return "def score(f):\n" + "".join(f"    {line}\n" for line in lines)


# --- stage 0 ----------------------------------------------------------------------------------------

ACCEPTED = [
    BENIGN,
    RICH,
    body("x = torch.maximum(f.key_norm, -f.value_norm)", "return x"),
    body("return group_max(f.attn) + group_max(f.last_attn)"),
    body("x = group_max(f.attn)", "x = x + pool(x, 3)", "x = x + pool(x, 3)", "return x"),
    body("a = f.key_norm + f.value_norm", "return torch.clamp(a, -1.0, 1.0) * f.layer - a / f.n"),
]

REJECTED = [
    ("dunder attribute", body("return f.key_norm.__class__"), "attribute access"),
    ("f.__dict__", body("return f.__dict__"), "not a feature"),
    ("while", body("while True:", "    pass", "return f.key_norm"), "while"),
    ("lambda", body("g = lambda x: x", "return f.key_norm"), "lambda"),
    ("import in score", body("import os", "return f.key_norm"), "import"),
    ("import at top", "import os\n" + BENIGN, "import"),
    ("unassigned name", body("return y"), "'y'"),
    ("torch.save", body("x = torch.save(f.key_norm, 1)", "return f.key_norm"), "torch.save"),
    ("torch.load", body("return torch.load(1)"), "torch.load"),
    ("string constant", body('x = "abc"', "return f.key_norm"), "str"),
    ("f-string", body('return f"{f}"'), "f-string"),
    ("SELECTION out of range", 'SELECTION = {"chunk_size": 100}\n' + BENIGN, "SELECTION"),
    ("SELECTION unknown key", 'SELECTION = {"recent": 3}\n' + BENIGN, "SELECTION"),
    ("open", body("return open(1)"), "'open'"),
    ("__import__", body("return __import__(1)"), "'__import__'"),
    ("getattr", body("return getattr(f, 1)"), "'getattr'"),
    ("eval", body("return eval(1)"), "'eval'"),
    ("huge int", body("x = 10 ** 10", "return f.key_norm"), "exponent of **"),
    ("list repetition", body("x = [0] * 1000", "return f.key_norm"), "a list"),
    ("subscript store", body("f.attn[0] = 1.0", "return f.key_norm"), "`name = expression`"),
    ("in-place method", body("x = f.attn.clamp_(0)", "return f.key_norm"), "clamp_"),
    ("unbounded for", body("for x in f.attn:", "    pass", "return f.key_norm"), "a for loop"),
    ("big loop", body("for i in range(100):", "    for j in range(100):", "        pass", "return f.key_norm"),
     "a for loop"),
    ("class", "class A:\n    pass\n" + BENIGN, "ClassDef"),
    ("second function", BENIGN + "\ndef helper(x):\n    return x\n", "FunctionDef"),
    ("two params", "def score(f, g):\n    return f.key_norm\n", "parameter"),
    ("no score", '"""doc"""\n', "exactly once"),
    ("shadowing", body("pool = f.attn", "return f.key_norm"), "pool"),
    ("bare torch", body("t = torch", "return f.key_norm"), "torch"),
    ("kwargs", body("return pool(**f)"), "keyword"),
    ("comprehension", body("x = [i for i in range(3)]", "return f.key_norm"), "comprehension"),
    ("with", body("with f:", "    pass", "return f.key_norm"), "With"),
    ("try", body("try:", "    pass", "except Exception:", "    pass", "return f.key_norm"), "Try"),
    ("global", body("global x", "return f.key_norm"), "Global"),
    ("syntax error", "def score(f)\n    return 1\n", "syntax"),
    ("too long", body("x = 1.0", *["x = x + 1.0"] * 700, "return f.key_norm"), "characters"),
    ("deep nesting", body("return " + "-" * 500 + "f.key_norm"), "deep"),
]


@pytest.mark.parametrize("source", ACCEPTED)
def test_static_accepts_programs_of_the_interface(source):
    check_source(source)


@pytest.mark.parametrize("name,source,needle", REJECTED, ids=[r[0] for r in REJECTED])
def test_static_rejects(name, source, needle):
    with pytest.raises(StaticCheckError) as err:
        check_source(source)
    assert needle in str(err.value)


def test_static_names_the_line():
    with pytest.raises(StaticCheckError, match="line 3"):
        check_source(body("x = f.key_norm", "y = x.__class__", "return x"))


# --- stage 1, in process ----------------------------------------------------------------------------


def test_invariants_hold_for_a_benign_program():
    invariants, reason = check_invariants(ScoreProgram(RICH), Program(RICH), WINDOW, seeds=(0,))
    assert reason == "" and invariants == dict.fromkeys(INVARIANTS, True)


@pytest.mark.parametrize("allocation", ["layer", "global"])
def test_a_budget_shared_between_heads_passes_the_budget_invariant(allocation):
    """Under "layer"/"global" allocation a head may keep more than the per-head budget: the invariant bounds the
    layer's total, so such programs (and the surrogate seed) reach the dev set instead of failing stage 1."""
    source = f"SELECTION = {{'allocation': {allocation!r}, 'sink': 2}}\n\ndef score(f):\n    return f.key_norm\n"
    invariants, reason = check_invariants(ScoreProgram(source), Program(source), WINDOW, seeds=(0, 1))
    assert reason == "" and invariants["budget"], reason
    seed = SEEDS["surrogate"]
    assert check_invariants(ScoreProgram(seed), Program(seed), WINDOW, seeds=(0,))[1] == ""


@pytest.mark.parametrize("allocation", ["uniform", "layer"])
def test_the_budget_invariant_catches_a_selection_that_keeps_too_much(allocation, monkeypatch):
    @dataclass(frozen=True)
    class Greedy(Selection):  # keeps every entry whatever the budget
        def kept_indices(self, scores, kept, protected_tail=0):
            return torch.arange(scores.shape[-1]).expand(*scores.shape), None

    monkeypatch.setattr(Program, "selection", lambda self, window: Greedy(allocation=allocation))
    source = "def score(f):\n    return f.key_norm\n"
    invariants, reason = check_invariants(ScoreProgram(source), Program(source), WINDOW, seeds=(0,))
    assert invariants["budget"] is False and "invariant 'budget' fails" in reason


def test_invariants_catch_nondeterminism():
    calls = [0]

    def score(f):
        calls[0] += 1
        return f.key_norm + calls[0]

    invariants, reason = check_invariants(score, Program(BENIGN), WINDOW, seeds=(0,))
    assert invariants["deterministic"] is False and "deterministic" in reason


def test_invariants_catch_input_mutation():
    def score(f):
        f.attn.clamp_(max=0.0)
        return f.key_norm.clone()

    invariants, reason = check_invariants(score, Program(BENIGN), WINDOW, seeds=(0,))
    assert invariants["inputs_unchanged"] is False and "inputs_unchanged" in reason


def test_invariants_catch_wrong_type_and_dtype():
    invariants, _ = check_invariants(lambda f: [1.0], Program(BENIGN), WINDOW, seeds=(0,))
    assert invariants == {"tensor": False}
    invariants, reason = check_invariants(lambda f: f.key_norm.long(), Program(BENIGN), WINDOW, seeds=(0,))
    assert invariants == {"tensor": True, "float": False} and "int64" in reason


# --- the sandbox --------------------------------------------------------------------------------------


def test_sandbox_env_carries_no_secrets(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSIEVE_TEST_SECRET", "kvsieve-test-secret")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-kvsieve-test-secret")
    env = sandbox_env(tmp_path, 2)
    assert "KVSIEVE_TEST_SECRET" not in env and "OPENAI_API_KEY" not in env
    assert not any(k.endswith(("_KEY", "_TOKEN", "_SECRET")) for k in env)
    assert env["HOME"] == env["TMPDIR"] == str(tmp_path) and env["OMP_NUM_THREADS"] == "2"
    assert "secret" not in " ".join(env.values())


def test_isolation_level_is_known():
    assert isolation_level() in ISOLATION_LEVELS


def test_benign_scores_equal_in_process(features_path):
    result = run_in_sandbox(RICH, features_path, window=WINDOW, limits=FAST)
    assert result.status == "ok", result.reason
    assert result.invariants == dict.fromkeys((*INVARIANTS, "linear_work"), True)  # and the work growth
    expected = {key: ScoreProgram(RICH)(feats) for key, feats in load_features(features_path).items()}
    assert set(result.scores) == set(expected)
    for key, scores in expected.items():
        assert result.scores[key].dtype == torch.float32 and torch.equal(result.scores[key], scores.float())


def test_without_features_only_the_invariants_run():
    result = run_in_sandbox(BENIGN, window=WINDOW, limits=FAST)
    assert (result.status, result.scores) == ("ok", {}) and all(result.invariants.values())


@pytest.mark.parametrize("source,status,needle", [
    (body("return f.attn"), "rejected", r"score must return scores shaped (b, h, n), this returns (b, h, g, n)"),
    (body("x = f.key_norm - f.key_norm", "return x / x"), "invalid", "finite"),
    (body("return f.n"), "rejected", "this returns a number"),
], ids=["wrong shape", "nan", "not a tensor"])
def test_stage1_failures_are_invalid(source, status, needle, features_path):
    result = run_in_sandbox(source, features_path, window=WINDOW, limits=FAST)
    assert result.status == status and needle in result.reason and result.scores == {}


def test_candidate_exception_is_a_short_error():
    # a division by zero of numbers: the program's own run-time error
    result = run_in_sandbox(body("return f.key_norm * (1 / (f.window - f.window))"), window=WINDOW, limits=FAST)
    assert result.status == "error"
    assert result.reason.startswith("ProgramFailed: program line 2: ZeroDivisionError"), result.reason
    assert "/" not in result.reason.split("ZeroDivisionError")[0]  # no traceback, no paths


def test_result_json_depth_is_bounded():
    assert sandbox.json_depth_ok(b'{"a": [1, {"b": "[[[["}]}')
    assert not sandbox.json_depth_ok(b"[" * 100000)
    assert sandbox.json_depth_ok(b'"' + b"[" * 100 + b'"')  # brackets inside a string do not count


def test_a_sleeper_cannot_hang_a_program_policy():
    """``kvsieve eval --policies program:best.py``: a program that turns hostile past some length cannot be written
    (the language has no if), one that holds too much is refused before it runs, and the wall-clock guard stops a
    slow call between two operations."""
    sleeper = body("x = group_mean(f.attn)", "if f.n > 1000:",
                   "    x = (f.key_norm.unsqueeze(-1) * f.key_norm.unsqueeze(-2)).sum(dim=-1)", "return x")
    with pytest.raises(ValueError, match="line 3: an if statement is not allowed"):
        ProgramPolicy(source=sleeper, window=4)
    hoarder = body(*(f"a{i} = f.attn * {i + 1}" for i in range(64)),
                   "return group_mean(" + " + ".join(f"a{i}" for i in range(64)) + ")")
    policy = ProgramPolicy(source=hoarder, window=4)
    start = time.perf_counter()
    with pytest.raises(LimitExceeded, match="MiB live at once, over the budget"):
        policy.score(_signals(5000))
    assert time.perf_counter() - start < 5
    busy = body("return " + " + ".join(f"torch.tanh(f.key_norm * {i + 1})" for i in range(80)))
    with pytest.raises(WallClockExceeded, match="limit: running longer than 0.0001 s"):
        ProgramPolicy(source=busy, window=4, deadline_s=0.0001).score(_signals(100000))


def _signals(n: int) -> Signals:
    g = torch.Generator().manual_seed(n)
    keys, values = torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)
    queries = torch.randn(1, 6, 4, 8, generator=g)
    return Signals(keys=keys, values=values, window_queries=queries, positions=torch.arange(n).expand(1, 2, n),
                   layer_idx=0, num_layers=2, scaling=8**-0.5)


def test_program_file_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text(body("import os", "return f.key_norm"))
    with pytest.raises(ValueError, match=f"{path}.*line 2"):
        ProgramPolicy(path=str(path))
    path.write_text('SELECTION = {"sink": 99}\n' + BENIGN)
    with pytest.raises(ValueError, match=f"{path}.*sink"):
        ProgramPolicy(path=str(path))


# --- the hostile corpus, layer by layer -------------------------------------------------------------
#
# Every case runs against (a) the interpreter alone (in this process, no static check, no sandbox),
# (b) the process layer alone (the sandbox with the interpreter bypassed: the program runs as plain
# Python through tests/evolve/sandbox_raw_loader.py, builtins and all) and (c) both (the sandbox as evolution
# uses it, static check skipped). Each level asserts the specific reason. docs/security.md has the
# table these tests produce; a case whose layer does not stop it says so here (None) and there.

LOADER = str(Path(__file__).with_name("sandbox_raw_loader.py"))
SECRET = "kvsieve-corpus-secret-3141"
OUTSIDE = "{outside}"  # replaced per test: a path outside the job dir that must stay absent
MOD = OS + '["sys"].modules'


@dataclass(frozen=True)
class Case:
    source: str
    static: str | None  # what stage 0 says (None: it passes stage 0)
    interpreter: str | None  # the interpreter's reason, in process (None: a stage-1 property, not its job)
    process: tuple[str, str]  # (status, reason) in the sandbox with the interpreter bypassed
    both: tuple[str, str] | None = None  # (status, reason) in the sandbox with the interpreter; None: the
    #                                      interpreter's reason, "killed" for a limit and "invalid" otherwise
    features: str = ""  # score a features file too: "short" (n 90) or "long" (n 20000)
    source_name: str = ""  # the case's name in CORPUS (filled in below)

    @property
    def language(self) -> str | None:
        """What the language's parser says (None: the program is in the language)."""
        return LANGUAGE_REFUSES.get(self.source_name, "is not an operation of the language")

    def expected_both(self) -> tuple[str, str]:
        if self.language is not None:  # the worker parses the program: refused before anything of it runs
            return "invalid", self.language
        return self.both


GLOBALS = "the attribute '__globals__'"
CALL = "calling subscript"
REFUSED = ("error", "PermissionError: [Errno 1] Operation not permitted")  # the seccomp filter
# the wall-clock guard (only Python run by the tests' raw loader can reach it): killed, retried, then the run stops
# with SandboxUnavailable; no result is stored for the candidate, so none depends on the machine's load
GUARD = ("unavailable", "passed the wall-clock guard of 8 s")

CORPUS = {
    "import os": Case("import os\n" + body("z = os.system('true')", "return f.key_norm"),
                      "import is not allowed at the top level", "Import at the top level",
                      ("error", "sandbox: os.system")),
    "open outside": Case(body(f'z = open("{OUTSIDE}", "w").write("x")', "return f.key_norm"), ".write",
                         "the name 'open'", ("error", "sandbox: open outside the job directory")),
    "__import__": Case(body('z = __import__("os").system("true")', "return f.key_norm"), ".system",
                       "the name '__import__'", ("error", "sandbox: os.system")),
    # harmless at the process layer: reading the class of f is no damage (nothing else is reachable)
    "dunder getattr": Case(body('z = getattr(f, "__cla" + "ss__")', "return f.key_norm"), "call to 'getattr'",
                           "the name 'getattr'", ("ok", "")),
    "escape, then open()": Case(body(f'z = {OS}["__builtins__"]["open"]("{OUTSIDE}", "w").write("x")',
                                     "return f.key_norm"), ".write", GLOBALS, ("error", "sandbox: open outside")),
    "escape, then os.system": Case(body(f'z = {OS}["system"]("touch {OUTSIDE}")', "return f.key_norm"), CALL,
                                   GLOBALS, ("error", "sandbox: os.system")),
    "escape, then os.open": Case(body(f'z = {OS}["open"]("{OUTSIDE}", 65)', "return f.key_norm"), CALL, GLOBALS,
                                 ("error", "sandbox: open outside")),
    "escape, then socket": Case(body(f'z = {MOD}["socket"].socket().connect(("1.1.1.1", 80))',
                                     "return f.key_norm"), ".connect", GLOBALS, ("error", "sandbox: socket.__new__")),
    "host unix socket": Case(body(f'z = {MOD}["_socket"].socket(1, 1)', "return f.key_norm"), ".socket", GLOBALS,
                             ("error", "sandbox: socket.__new__")),
    "escape, then subprocess": Case(body(f'z = {MOD}["subprocess"].run(["touch", "{OUTSIDE}"])',
                                         "return f.key_norm"), ".run", GLOBALS, ("error", "sandbox: subprocess.Popen")),
    "escape, then fork_exec": Case(body(f'z = {MOD}["_posixsubprocess"].fork_exec()', "return f.key_norm"),
                                   ".fork_exec", GLOBALS, ("error", "sandbox: starting processes is not allowed")),
    "setsid child outlives the run": Case(body(f'if {OS}["fork"]() == 0:', f'    z = {OS}["setsid"]()',
                                               "return f.key_norm"), CALL, GLOBALS, ("error", "sandbox: os.fork")),
    "kill the parent": Case(body(f'z = {OS}["kill"]({OS}["getppid"](), 9)', "return f.key_norm"), CALL, GLOBALS,
                            ("error", "sandbox: os.kill")),
    "pidfd signal to the parent": Case(body(f'fd = {OS}["pidfd_open"]({OS}["getppid"]())',
                                            f'z = {MOD}["signal"].pidfd_send_signal(fd, 18)', "return f.key_norm"),
                                       CALL, GLOBALS, REFUSED),
    "memfd holds memory": Case(body(f'fd = {OS}["memfd_create"]("x")', f'z = {OS}["ftruncate"](fd, 1 << 30)',
                                    "return f.key_norm"), CALL, GLOBALS, REFUSED),
    "fallocate reserves disk": Case(body(f'z = {OS}["posix_fallocate"](1, 0, 1 << 30)', "return f.key_norm"), CALL,
                                    GLOBALS, REFUSED),
    "audit hook switched off via its globals": Case(body(
        f'w = {MOD}["kvsieve.evolve.process_guards"]', 'w._DENIED_PREFIXES, w._PATH_EVENTS = ("\\0",), {}',
        f'z = open("{OUTSIDE}", "w").write("x")', "return f.key_norm"), ".modules", GLOBALS,
        ("error", "sandbox: open outside")),
    "path check switched off via posixpath": Case(body(
        f'p = {MOD}["posixpath"]', 'p._joinrealpath = lambda path, rest, strict, seen: ("/job", True)',
        f'z = open("{OUTSIDE}", "w").write("x")', "return f.key_norm"), ".modules", GLOBALS,
        ("error", "sandbox: open outside")),
    "torch.from_file reads a secret": Case(body(f'x = {MOD}["torch"].from_file("{{secret}}", size=8)',
                                                "return f.key_norm"), ".from_file", GLOBALS,
                                           ("error", "torch.from_file is not allowed")),
    "secret into the reason": Case(body('raise ValueError(open("{secret}").read())'), "raise", "Raise",
                                   ("error", "sandbox: open outside")),
    "raw block device": Case(body('z = open("/dev/vda", "rb").read(512)', "return f.key_norm"), ".read",
                             "the name 'open'", ("error", "sandbox: open outside")),
    "forged deep result frame": Case(body(
        f'z = {OS}["write"](1, {MOD}["struct"].pack("<Q", 100000) + b"[" * 100000 + bytes(8))', "return f.key_norm"),
        CALL, GLOBALS, ("error", "nests deeper than")),
    "crash by abort": Case(body(f'z = {OS}["abort"]()', "return f.key_norm"), CALL, GLOBALS,
                           ("killed", "killed by signal")),  # SIGSEGV: as PID 1 of its namespace it ignores SIGABRT
    "memory bomb": Case(body("x = [0] * 10 ** 10", "return f.key_norm"), "repetition", "Mult on a list",
                        ("killed", "memory limit")),
    "endless loop": Case(body("while True:", "    pass", "return f.key_norm"), "while loop", "While",
                         GUARD),
    # these pass stage 0: names hide the sizes from it
    "integer bomb from names": Case(body("a = 1000000", "b = a * a * a * a", "return f.key_norm + b"), None,
                                    "limit: an integer of about 80 bits", ("error", "OverflowError")),
    "range bomb": Case(body("a = 1000", "x = max(range(a * a * a))", "return f.key_norm"), None,
                       "limit: a sequence or range of 1000000000 items", GUARD),
    "sequence bomb": Case(body("a = 100000", "x = f.key_norm.shape * a", "y = x * a", "return f.key_norm"), None,
                          "Mult on a tuple", ("killed", "memory limit")),
    "outer product sleeper": Case(body("x = f.key_norm", "if f.n > 200:",
                                       "    x = (f.key_norm.unsqueeze(-1) * f.value_norm.unsqueeze(-2)).mean(dim=-1)",
                                       "return x"), None, "limit: a tensor of 50000000 elements",
                                  ("killed", "memory limit"), ("killed", "limit: a tensor of 800000000 elements"),
                                  features="long"),
    "in-place add on an input": Case(body("a = f.key_norm", "a += 1.0", "return a"), None, None,
                                     ("invalid", "inputs_unchanged"), ("ok", "")),
    "behaves only on synthetic shapes": Case(body("x = group_mean(f.attn)",
                                                  "if f.n != f.window + 5 and f.n != 4 * f.window + 37:",
                                                  "    x = x / 0.0", "return x"), None, None,
                                             ("invalid", "n 90"), ("invalid", "n 90"), features="short"),
}


def _fill(source: str, tmp_path) -> tuple[str, Path]:
    outside = tmp_path / "outside.txt"
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    return source.replace(OUTSIDE, str(outside)).replace("{secret}", str(secret)), outside


# What the language's parser says of each case (issue 48): every attack but one is text the language cannot express;
# the integer bomb folds to a float (1e24) and runs harmlessly. Cases not named here escape through a call of
# something that is not an operation.
LANGUAGE_REFUSES: dict[str, str | None] = {
    "import os": "an import", "dunder getattr": "'getattr' is not an operation",
    "setsid child outlives the run": "an if statement", "audit hook switched off via its globals": "indexing",
    "path check switched off via posixpath": "indexing", "secret into the reason": "must end with `return",
    "memory bomb": "a list", "endless loop": "a while loop", "integer bomb from names": None,
    "range bomb": "'max' is not an operation", "sequence bomb": "attribute access",
    "outer product sleeper": "an if statement", "in-place add on an input": "augmented assignment",
    "behaves only on synthetic shapes": "an if statement",
}
CORPUS = {name: replace(case, source_name=name, both=case.both if name != "integer bomb from names" else ("ok", ""))
          for name, case in CORPUS.items()}


@pytest.mark.parametrize("name", list(CORPUS))
def test_corpus_stage0(name):
    case = CORPUS[name]
    if case.language is None:
        check_source(case.source)
        return
    with pytest.raises(StaticCheckError) as err:
        check_source(case.source)
    assert case.language in str(err.value) and len(str(err.value)) < 400, str(err.value)


@pytest.mark.parametrize("name", list(CORPUS))
def test_corpus_interpreter_alone(name, tmp_path):
    case = CORPUS[name]
    source, outside = _fill(case.source, tmp_path)
    features = synthetic_features(0, group=3, n=5000, window=WINDOW)
    before = {k: v.clone() for k, v in features.tensors().items()}
    if case.language is None:  # in the language: the interpreter runs it, harmlessly
        out = ScoreProgram(source)(features)
        assert isinstance(out, torch.Tensor)
        assert all(torch.equal(before[k], v) for k, v in features.tensors().items())
        return
    with pytest.raises(InterpreterError) as err:  # the interpreter is the language: it refuses what it cannot parse
        ScoreProgram(source)(features)
    assert case.language in str(err.value), str(err.value)
    assert not outside.exists()


@pytest.fixture(scope="module")
def long_features_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("long") / "long.safetensors"
    save_features(path, {"long": synthetic_features(0, group=1, n=20000, window=WINDOW)})
    return path


def _sandboxed(case: Case, tmp_path, paths: dict, raw: bool) -> SandboxResult:
    source, outside = _fill(case.source, tmp_path)
    layers = {"raw_loader": LOADER} if raw else None
    limits = SandboxLimits(timeout_s=8.0, memory_mb=1536)
    start = time.perf_counter()
    try:
        result = run_in_sandbox(source, paths.get(case.features), window=WINDOW, limits=limits, static_check=False,
                                layers=layers)
    except SandboxUnavailable as err:  # the guard, hit on every try: no result (the process was killed each time)
        assert not outside.exists()
        assert time.perf_counter() - start < (1 + sandbox.INFRA_RETRIES) * 60
        return SandboxResult("unavailable", str(err), time.perf_counter() - start)
    assert not outside.exists()
    assert SECRET not in result.reason
    assert result.seconds < 60
    return result


@pytest.mark.parametrize("name", list(CORPUS))
def test_corpus_process_layer_alone(name, tmp_path, features_path, long_features_path):
    case = CORPUS[name]
    result = _sandboxed(case, tmp_path, {"short": features_path, "long": long_features_path}, raw=True)
    status, reason = case.process
    assert (result.status, reason in result.reason) == (status, True), (result.status, result.reason)


# the cases the issue found getting through at the "network" and "none" levels
WITHOUT_NAMESPACES = ["open outside", "escape, then os.open", "host unix socket", "setsid child outlives the run",
                      "kill the parent", "pidfd signal to the parent", "memfd holds memory", "fallocate reserves disk",
                      "raw block device", "torch.from_file reads a secret", "audit hook switched off via its globals"]


@pytest.mark.parametrize("name", WITHOUT_NAMESPACES)
def test_corpus_process_layer_alone_without_namespaces(name, tmp_path, monkeypatch, features_path, long_features_path):
    """The same cases at isolation "none" (no unshare at all): seccomp, the audit hook and the limits alone."""
    monkeypatch.setenv("KVSIEVE_SANDBOX_ISOLATION", "none")
    case = CORPUS[name]
    result = _sandboxed(case, tmp_path, {"short": features_path, "long": long_features_path}, raw=True)
    status, reason = case.process
    assert result.isolation.startswith("none")
    assert (result.status, reason in result.reason) == (status, True), (result.status, result.reason)


@pytest.mark.parametrize("name", list(CORPUS))
def test_corpus_both_layers(name, tmp_path, features_path, long_features_path):
    case = CORPUS[name]
    result = _sandboxed(case, tmp_path, {"short": features_path, "long": long_features_path}, raw=False)
    status, reason = case.expected_both()
    assert (result.status, reason in result.reason) == (status, True), (result.status, result.reason)


@pytest.mark.skipif(isolation_level() != "full", reason="full isolation is not available here")
def test_full_isolation_alone_hides_the_machine(tmp_path):
    """The kernel layer without any Python guard: a shell in the worker's namespaces sees a minimal
    root (no project, no home, no /dev disks), cannot write outside its capped scratch, has no network
    and runs as an unprivileged uid."""
    job = tmp_path / "job"
    sandbox._make_job_dirs(job)
    project = Path(__file__).resolve().parents[2]
    # the home folder may hold the Python installation (pyenv): that path is bound, nothing else of home
    home = [p for p in Path.home().iterdir() if not sys.base_prefix.startswith(str(p))] or [Path.home() / "x"]
    script = (f'echo $(id -u); [ -e "{project}/tests" ] && echo project; [ -e "{home[0]}" ] && echo home; '
              '[ -e /dev/vda ] || [ -e /dev/sda ] && echo disk; echo x > /job/x 2>/dev/null && echo jobwrite; '
              'echo ok > /tmp/in && echo scratch; ls /proc | grep -c "^[0-9]"; '
              'cat /sys/class/net/*/operstate 2>/dev/null | grep -c up')
    done = subprocess.run(sandbox._wrap(job, ["/bin/sh", "-c", script], "full", 4), capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin"})
    lines = done.stdout.split()
    assert lines[0] != "0" and "project" not in lines and "home" not in lines and "disk" not in lines
    assert "jobwrite" not in lines and "scratch" in lines
    assert int(lines[-2]) <= 4  # only the sandbox's own processes are visible
    assert lines[-1] == "0"  # no interface is up


def test_candidate_cannot_obtain_secrets(monkeypatch, features_path):
    """Run as plain Python in the worker, the program reads its environment and /proc/PID/environ of its
    parent and of a process holding the secret. It scores what it found (+1 each) and what failed
    (+100 each); run here, unsandboxed, the same code finds the secret twice, so the assertion on the
    sandboxed run can fail."""
    monkeypatch.setenv("KVSIEVE_TEST_SECRET", "kvsieve-test-secret")
    holder = subprocess.Popen(["sleep", "60"], env={"PATH": "/usr/bin:/bin",
                                                    "KVSIEVE_TEST_SECRET": "kvsieve-test-secret"})
    attack = body(
        "found, refused = 0.0, 0.0",
        f"env = {OS}",
        'if env["environ"].get("KVSIEVE_TEST_SECRET"):',
        "    found += 1.0",
        f"for pid in (env['getppid'](), {holder.pid}):",
        "    try:",
        '        if b"kvsieve-test-secret" in env["__builtins__"]["open"](f"/proc/{pid}/environ", "rb").read():',
        "            found += 1.0",
        "    except Exception:",
        "        refused += 100.0",
        "return f.key_norm * 0.0 + found + refused",
    )
    spec = importlib.util.spec_from_file_location("raw_loader", LOADER)
    loader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loader)
    try:
        # unsandboxed: environ and the holder's /proc (the parent's may be unreadable: pytest orphaned under init)
        assert float(loader.load(attack)(synthetic_features(0)).max()) % 100.0 == 2.0
        result = run_in_sandbox(attack, features_path, window=WINDOW, limits=FAST, static_check=False,
                                layers={"raw_loader": LOADER})
    finally:
        holder.kill()
        holder.wait()
    assert result.status == "ok", result.reason
    assert all(torch.equal(s, torch.full_like(s, 200.0)) for s in result.scores.values())


def test_parent_survives_and_benign_still_runs(features_path):
    result = run_in_sandbox(BENIGN, features_path, window=WINDOW, limits=FAST)
    assert result.status == "ok" and set(result.scores) == {"s0-l0", "s0-l1"}


def test_job_dirs_are_removed_kept_on_request_and_orphans_swept(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox.tempfile, "tempdir", str(tmp_path))
    sandbox._sweep_orphans.cache_clear()
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = tmp_path / f"kvsieve-sandbox-{dead.pid}-abc"
    orphan.mkdir()
    assert run_in_sandbox(BENIGN, window=WINDOW, limits=FAST).status == "ok"
    assert list(tmp_path.iterdir()) == []  # the orphan swept, this run's dir removed
    monkeypatch.setenv("KVSIEVE_KEEP_SANDBOX", "1")
    assert run_in_sandbox(BENIGN, window=WINDOW, limits=FAST).status == "ok"
    (kept,) = tmp_path.iterdir()
    assert {"in", "root", "KEPT"} == {p.name for p in kept.iterdir()}
    assert {"program.py", "job.json"} == {p.name for p in (kept / "in").iterdir()}
    sandbox._sweep_orphans.cache_clear()


def test_the_languages_shape_rule_follows_torch_broadcasting():
    """Where the symbols agree, torch broadcasts to the shape the checker infers (dims given distinct sizes)."""
    import itertools

    from kvsieve.language import operations as ops

    sizes = {"b": 2, "h": 3, "g": 5, "n": 7}
    shapes = [(), ("n",), ("b", "h", "n"), ("b", "h", "g", "n")]
    for a, b in itertools.product(shapes, repeat=2):
        try:
            inferred = ops.broadcast(a, b)
        except ops.TypeRefusal:
            assert {a, b} == {("b", "h", "n"), ("b", "h", "g", "n")}, (a, b)
            continue
        actual = torch.broadcast_shapes(tuple(sizes[d] for d in a), tuple(sizes[d] for d in b))
        assert tuple(actual) == tuple(sizes[d] for d in inferred), (a, b)


def test_interpreted_scores_equal_plain_tensor_maths():
    """The interpreter computes what the same expressions compute when written out by hand."""
    f = synthetic_features(4, group=3, n=300, window=WINDOW)
    a = f.attn.mean(dim=2)
    expected = 0.4 * (a / a.abs().mean(dim=-1, keepdim=True).clamp_min(1e-12)) + torch.maximum(
        f.key_norm, -f.value_norm) ** 2
    source = body("a = group_mean(f.attn)", "x = torch.maximum(f.key_norm, -f.value_norm)",
                  "return 0.4 * unit_mean(a) + x ** 2")
    assert torch.allclose(ScoreProgram(source)(f), expected, rtol=0, atol=0)
