"""Stage 0 (static check), stage 1 (invariants) and the sandbox against hostile candidates.

Each hostile candidate is rejected by the static check, and with the static check skipped it still
fails inside the sandbox (error or killed) while this process carries on.
"""

from __future__ import annotations

import errno
import subprocess
import sys

import pytest
import torch

from kvsieve.evolve import sandbox
from kvsieve.evolve.features import compile_score, load_features, save_features, synthetic_features
from kvsieve.evolve.program import Program
from kvsieve.evolve.sandbox import (
    ISOLATION_LEVELS,
    SandboxLimits,
    isolation_level,
    run_in_sandbox,
    sandbox_env,
)
from kvsieve.evolve.static import StaticCheckError, check_source
from kvsieve.evolve.worker import INVARIANTS, check_invariants

WINDOW = 8
BENIGN = "def score(f):\n    return pool(group_mean(f.attn), 5)\n"
RICH = '''"""Touches most of the interface, to show the guards leave it working."""
SELECTION = {"chunk_size": 2, "sink": 1}


def score(f):
    a = group_mean(f.attn)
    m = f.last_attn.amax(dim=2)
    x = torch.where(a > a.mean(dim=-1, keepdim=True), a, 0.5 * a)
    for i in range(3):
        x = x + 0.1 * max_pool(m, 3) * i
    z = torch.softmax(x, dim=-1) + rank(f.key_norm) + normalize(f.value_norm) + torch.logsumexp(f.attn, dim=2)
    v = f.attn.max(dim=2).values + torch.stack([a, m]).sum(dim=0) + x.std(dim=-1, keepdim=True)
    v = v + torch.cumsum(a, dim=-1).flip(-1) * 0.001 + unit_mean(a) + torch.roll(a, 1, -1).sqrt()
    return z + v + f.position * f.layer + min(f.n, 3) * 0.0
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
    body("x = torch.where(f.key_norm > 1.0, f.key_norm, -f.value_norm)", "return x"),
    body("return f.attn.amax(dim=2) + f.last_attn.amax(dim=2)"),
    body("x = group_max(f.attn)", "for i in range(3):", "    x = x + pool(x, 3)", "return x"),
    body("a, b = f.key_norm, f.value_norm", "a += b[..., :]", "return a if f.layer < 0.5 else -a"),
]

REJECTED = [
    ("dunder attribute", body("return f.key_norm.__class__"), "'_'"),
    ("f.__dict__", body("return f.__dict__"), "'_'"),
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
    ("huge int", body("x = 10 ** 10", "return f.key_norm"), "integer"),
    ("list repetition", body("x = [0] * 1000", "return f.key_norm"), "repetition"),
    ("subscript store", body("f.attn[0] = 1.0", "return f.key_norm"), "assignment"),
    ("in-place method", body("x = f.attn.clamp_(0)", "return f.key_norm"), "clamp_"),
    ("unbounded for", body("for x in f.attn:", "    pass", "return f.key_norm"), "range"),
    ("big loop", body("for i in range(100):", "    for j in range(100):", "        pass", "return f.key_norm"),
     "iterations"),
    ("class", "class A:\n    pass\n" + BENIGN, "class"),
    ("second function", BENIGN + "\ndef helper(x):\n    return x\n", "function"),
    ("two params", "def score(f, g):\n    return f.key_norm\n", "parameter"),
    ("no score", '"""doc"""\n', "exactly once"),
    ("shadowing", body("pool = f.attn", "return f.key_norm"), "pool"),
    ("bare torch", body("t = torch", "return f.key_norm"), "torch"),
    ("kwargs", body("return pool(**f)"), "**kwargs"),
    ("comprehension", body("x = [i for i in range(3)]", "return f.key_norm"), "comprehension"),
    ("with", body("with f:", "    pass", "return f.key_norm"), "with"),
    ("try", body("try:", "    pass", "except Exception:", "    pass", "return f.key_norm"), "try"),
    ("global", body("global x", "return f.key_norm"), "global"),
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
    invariants, reason = check_invariants(compile_score(RICH), Program(RICH), WINDOW, seeds=(0,))
    assert reason == "" and invariants == dict.fromkeys(INVARIANTS, True)


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
    assert result.invariants == dict.fromkeys(INVARIANTS, True)
    expected = {key: compile_score(RICH)(feats) for key, feats in load_features(features_path).items()}
    assert set(result.scores) == set(expected)
    for key, scores in expected.items():
        assert result.scores[key].dtype == torch.float32 and torch.equal(result.scores[key], scores.float())


def test_without_features_only_the_invariants_run():
    result = run_in_sandbox(BENIGN, window=WINDOW, limits=FAST)
    assert (result.status, result.scores) == ("ok", {}) and all(result.invariants.values())


@pytest.mark.parametrize("source,needle", [
    (body("return f.attn"), "shape"),
    (body("x = f.key_norm - f.key_norm", "return x / x"), "finite"),
    (body("return f.n"), "tensor"),
], ids=["wrong shape", "nan", "not a tensor"])
def test_stage1_failures_are_invalid(source, needle, features_path):
    result = run_in_sandbox(source, features_path, window=WINDOW, limits=FAST)
    assert result.status == "invalid" and needle in result.reason and result.scores == {}


def test_candidate_exception_is_a_short_error():
    result = run_in_sandbox(body("return f.key_norm[10 ** 6]"), window=WINDOW, limits=FAST)
    assert result.status == "error" and result.reason.startswith("IndexError")
    assert "/" not in result.reason  # no traceback, no paths


HOSTILE = {
    "import os": ("import os\n" + body("os.system(1)", "return f.key_norm"), "error"),
    "open outside": (body('open("{outside}", "w").write("x")', "return f.key_norm"), "error"),
    "__import__": (body('__import__("os").system("true")', "return f.key_norm"), "error"),
    "dunder getattr": (body('getattr(f, "__cla" + "ss__")', "return f.key_norm"), "error"),
    "escape, then open()": (body(f'{OS}["__builtins__"]["open"]("{{outside}}", "w").write("x")',
                                 "return f.key_norm"), "error"),
    "escape, then os.system": (body(f'{OS}["system"]("touch {{outside}}")', "return f.key_norm"), "error"),
    "escape, then os.open": (body(f'{OS}["open"]("{{outside}}", 65)', "return f.key_norm"), "error"),
    "escape, then socket": (body(f'{OS}["__builtins__"]["__import__"]("socket").socket().connect(("1.1.1.1", 80))',
                                 "return f.key_norm"), "error"),
    "escape, then subprocess": (body(f'{OS}["sys"].modules["subprocess"].run(["touch", "{{outside}}"])',
                                    "return f.key_norm"), "error"),
    "escape, then fork_exec": (body(f'{OS}["sys"].modules["_posixsubprocess"].fork_exec()', "return f.key_norm"),
                               "error"),
    "escape, then kill the parent": (body(f'{OS}["kill"]({OS}["getppid"](), 9)', "return f.key_norm"), "error"),
    "memory bomb": (body("x = [0] * 10 ** 10", "return f.key_norm"), "killed"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_candidates_fail_at_every_layer(name, tmp_path):
    outside = tmp_path / "outside.txt"
    source, status = HOSTILE[name]
    source = source.replace("{outside}", str(outside))
    with pytest.raises(StaticCheckError):
        check_source(source)
    assert run_in_sandbox(source, window=WINDOW, limits=FAST).status == "rejected"
    limits = SandboxLimits(timeout_s=20.0, memory_mb=1024)
    result = run_in_sandbox(source, window=WINDOW, limits=limits, static_check=False)
    assert result.status == status, (result.status, result.reason)
    assert result.seconds < 15
    assert not outside.exists()


def test_infinite_loop_is_killed_at_the_timeout():
    source = body("while True:", "    pass", "return f.key_norm")
    assert run_in_sandbox(source, window=WINDOW).status == "rejected"
    result = run_in_sandbox(source, window=WINDOW, limits=SandboxLimits(timeout_s=2.0), static_check=False)
    assert result.status == "killed" and "timed out after 2 s" in result.reason
    assert result.seconds < 10


def test_too_much_memory_on_real_features_is_killed(tmp_path):
    """Passes stages 0 and 1 (small synthetic n) but needs (b, h, n, n) floats on the real features."""
    path = tmp_path / "long.safetensors"
    save_features(path, {"long": synthetic_features(0, group=1, n=20000, window=WINDOW)})
    source = body("x = f.key_norm.unsqueeze(-1) * f.value_norm.unsqueeze(-2)", "return x.mean(dim=-1)")
    check_source(source)
    result = run_in_sandbox(source, path, window=WINDOW, limits=SandboxLimits(timeout_s=20.0, memory_mb=1024))
    assert result.status == "killed" and "memory" in result.reason and result.invariants["budget"]


@pytest.mark.skipif(isolation_level() != "namespaces", reason="unshare namespaces are not available here")
def test_namespaces_alone_stop_writes_and_network(tmp_path):
    """The kernel layer without the audit hook: read-only mounts but the job dir, no network."""
    job, outside = tmp_path / "job", tmp_path / "outside.txt"
    job.mkdir()
    code = ("import socket, sys\n"
            "try:\n    open(sys.argv[1], 'w')\nexcept OSError as e:\n    print('write', e.errno)\n"
            "try:\n    socket.create_connection(('1.1.1.1', 80), timeout=5)\nexcept OSError as e:\n"
            "    print('network', e.errno)\n"
            "open(sys.argv[2] + '/inside.txt', 'w').write('ok')\n")
    argv = [sys.executable, "-I", "-c", code, str(outside), str(job)]
    done = subprocess.run(sandbox._wrap(job, argv, "namespaces"), cwd=job, env=sandbox_env(job, 1),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"write {errno.EROFS}" in done.stdout and f"network {errno.ENETUNREACH}" in done.stdout
    assert not outside.exists() and (job / "inside.txt").read_text() == "ok"


def test_a_crash_reports_its_signal():
    result = run_in_sandbox(body(f'{OS}["abort"]()', "return f.key_norm"), window=WINDOW, limits=FAST,
                            static_check=False)
    assert result.status == "killed" and "SIGABRT" in result.reason


def test_candidate_cannot_obtain_secrets(monkeypatch, features_path):
    monkeypatch.setenv("KVSIEVE_TEST_SECRET", "kvsieve-test-secret")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-kvsieve-test-secret")
    source = body(
        "found = 0.0",
        f"env = {OS}",
        'if env["environ"].get("KVSIEVE_TEST_SECRET") or env["getenv"]("OPENAI_API_KEY"):',
        "    found += 1.0",
        "for pid in (env['getppid'](), 1, 2, 3):",
        "    try:",
        '        if b"kvsieve-test-secret" in env["__builtins__"]["open"](f"/proc/{pid}/environ", "rb").read():',
        "            found += 2.0",
        "    except:",
        "        pass",
        "return f.key_norm * 0.0 + found",
    )
    result = run_in_sandbox(source, features_path, window=WINDOW, limits=FAST, static_check=False)
    assert result.status == "ok", result.reason
    assert all(float(s.abs().max()) == 0.0 for s in result.scores.values())


def test_guards_alone_stop_an_escape(monkeypatch, tmp_path):
    """Without namespaces (as on machines without unshare) the audit hook still refuses the write."""
    monkeypatch.setenv("KVSIEVE_SANDBOX_ISOLATION", "none")
    outside = tmp_path / "outside.txt"
    source = body(f'{OS}["__builtins__"]["open"]("{outside}", "w").write("x")', "return f.key_norm")
    result = run_in_sandbox(source, window=WINDOW, limits=FAST, static_check=False)
    assert result.status == "error" and "sandbox: open" in result.reason
    assert not outside.exists()


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
    assert {"program.py", "job.json", "result.json", "KEPT"} <= {p.name for p in kept.iterdir()}
    sandbox._sweep_orphans.cache_clear()
