"""Run an untrusted candidate program away from the process that holds the model.

Layers, outermost first (each one alone should stop a hostile program; together they make a
mistake in any one of them survivable):

1. Stage 0 in this process: ``static.check_source`` (nothing runs); ``static_check=False`` skips it,
   only so tests can show that the layers below hold alone.
2. A separate process (``worker.py``) in a fresh temporary job directory (its cwd, HOME and TMPDIR),
   in its own session, with an environment built from scratch (:func:`sandbox_env`: no secrets), a
   wall-clock timeout after which its whole process group gets SIGKILL, and kernel limits it sets on
   itself before importing anything: address space (``memory_mb``), file size, CPU seconds, open
   files, no core dumps. (Set in the child's first lines rather than a ``preexec_fn``: the parent
   holds a model and threads, where ``preexec_fn`` can deadlock.)
3. Linux namespaces when ``unshare`` works here (probed once, :func:`isolation_level`):
   ``"namespaces"``: new user, network (no interfaces but a down loopback), mount and PID namespaces;
   every mount is read-only except the job directory, /proc shows only the sandbox's processes, and
   the worker runs in a further user namespace so it cannot remount anything writable.
   ``"network"``: only the user and network namespaces. ``"none"``: no unshare; the network is then
   refused by layer 4 only. ``KVSIEVE_SANDBOX_ISOLATION`` caps the level (for tests and debugging).
4. In the worker: restricted builtins (``features.compile_score``) and an audit hook, installed
   after torch and the features are loaded, that refuses files outside the job directory, sockets,
   processes, signals, ctypes, new imports and frame/GC introspection (``worker.install_guards``).

The worker's outputs are read with safetensors and json only (never pickle) and validated here.
``KVSIEVE_KEEP_SANDBOX=1`` keeps the job directories for debugging.
"""

from __future__ import annotations

import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from kvsieve.evolve.static import StaticCheckError, check_source

__all__ = ["SandboxLimits", "SandboxResult", "run_in_sandbox", "sandbox_env", "isolation_level", "STATUSES",
           "ISOLATION_LEVELS"]

STATUSES = ("ok", "rejected", "invalid", "error", "killed")
ISOLATION_LEVELS = ("none", "network", "namespaces")
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # .../kvsieve
MIN_MEMORY_MB = 1024  # importing torch maps ~0.7 GB of address space (measured: 512 MB fails, 768 MB works)
MAX_REASON = 500
MAX_RESULT_BYTES = 1 << 20
_READY = b"ready\n"
_JOB_PREFIX = "kvsieve-sandbox-"
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"

# Run by unshare as PID 1 of the new namespaces: make every mount read-only, bind the job dir over
# itself read-write, then run the worker in a nested user namespace (no capability over these mounts
# any more) as a child, so a signal that kills it shows as exit status 128 + signal.
_NS_SCRIPT = r"""
job=$1; shift
for m in $(awk '{print $5}' /proc/self/mountinfo | sort -u); do
  mount -o remount,bind,ro "$m" 2>/dev/null || exit 98
done
mount --bind "$job" "$job" && mount -o remount,bind,rw "$job" || exit 97
unshare --user "$@"
"""
_NS_FLAGS = ("--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc")

# The worker's first lines: kernel limits, then a stub ``kvsieve`` package so kvsieve/__init__.py
# (the engine, transformers) is not imported: 2.5 s less start-up and far fewer modules in reach.
_BOOT = """
import json, os, resource, sys, types
for name, (soft, hard) in json.loads(sys.argv[3]).items():
    resource.setrlimit(getattr(resource, name), (soft, hard))
package = types.ModuleType("kvsieve")
package.__path__ = [sys.argv[1]]
sys.modules["kvsieve"] = package
from kvsieve.evolve.worker import main
code = main(sys.argv[2])
sys.stdout.flush()
os._exit(code)
"""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run.

    ``timeout_s`` is wall-clock time for the candidate (compiling it, the invariants, the scoring),
    counted once the worker has started; ``startup_s`` bounds the start-up before that (spawn, torch
    import, reading the features), which is not the candidate's doing. ``memory_mb`` is the worker's
    address-space limit (at least 1024: torch alone maps ~0.7 GB).
    """

    timeout_s: float = 120.0
    memory_mb: int = 4096
    threads: int = 1
    file_mb: int = 256
    startup_s: float = 60.0

    def __post_init__(self) -> None:
        if not (self.timeout_s > 0 and self.startup_s > 0):
            raise ValueError(f"timeout_s and startup_s must be > 0, got {self.timeout_s}, {self.startup_s}")
        if self.memory_mb < MIN_MEMORY_MB:
            raise ValueError(f"memory_mb={self.memory_mb} is below {MIN_MEMORY_MB}: torch cannot even be imported")
        if self.threads < 1 or self.file_mb < 1:
            raise ValueError(f"threads and file_mb must be >= 1, got {self.threads}, {self.file_mb}")

    def rlimits(self) -> dict[str, tuple[int, int]]:
        cpu = math.ceil((self.startup_s + self.timeout_s) * self.threads) + 1
        return {"RLIMIT_AS": (self.memory_mb << 20,) * 2, "RLIMIT_FSIZE": (self.file_mb << 20,) * 2,
                "RLIMIT_CPU": (cpu, cpu + 1), "RLIMIT_CORE": (0, 0), "RLIMIT_NOFILE": (256, 256)}


@dataclass
class SandboxResult:
    """``status``: "ok", "rejected" (stage 0), "invalid" (stage 1 or bad outputs), "error" (the candidate
    raised, or the sandbox failed) or "killed" (timeout, memory, signal). ``scores`` only when "ok"."""

    status: str
    reason: str
    seconds: float
    scores: dict[str, torch.Tensor] = field(default_factory=dict)
    invariants: dict[str, bool] = field(default_factory=dict)


def sandbox_env(job_dir: str | os.PathLike, threads: int) -> dict[str, str]:
    """The worker's whole environment, built from scratch: nothing of ``os.environ`` is passed on."""
    job = os.fspath(job_dir)
    env = {"PATH": _SAFE_PATH, "HOME": job, "TMPDIR": job, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
           "PYTHONPATH": str(PACKAGE_DIR.parent), "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0",
           "OMP_WAIT_POLICY": "PASSIVE"}
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                 "VECLIB_MAXIMUM_THREADS"):
        env[name] = str(int(threads))
    return env


def isolation_level() -> str:
    """The strongest namespace isolation that works here (probed once), capped by
    ``KVSIEVE_SANDBOX_ISOLATION`` if set."""
    cap = os.environ.get("KVSIEVE_SANDBOX_ISOLATION", "namespaces")
    if cap not in ISOLATION_LEVELS:
        raise ValueError(f"KVSIEVE_SANDBOX_ISOLATION={cap!r} is not one of {ISOLATION_LEVELS}")
    level = _probe()
    return min(level, cap, key=ISOLATION_LEVELS.index)


@lru_cache(maxsize=1)
def _probe() -> str:
    unshare = shutil.which("unshare", path=_SAFE_PATH)
    if not unshare:
        return "none"
    with tempfile.TemporaryDirectory(prefix="kvsieve-probe-") as tmp:
        job, outside = Path(tmp, "job"), Path(tmp, "outside")
        job.mkdir()
        outside.mkdir()
        check = ['sh', '-c', 'echo ok > "$1/in"; echo leak > "$2/out" 2>/dev/null; exit 0', 'sh', str(job),
                 str(outside)]
        if (_quiet(_wrap(job, check, "namespaces"), job)
                and (job / "in").exists() and not (outside / "out").exists()):
            return "namespaces"
    if _quiet([unshare, "--user", "--map-root-user", "--net", "true"], None):
        return "network"
    return "none"


def _quiet(cmd: list[str], cwd: Path | None) -> bool:
    try:
        done = subprocess.run(cmd, cwd=cwd, env={"PATH": _SAFE_PATH}, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _command(job: Path, limits: SandboxLimits, level: str) -> list[str]:
    worker = [sys.executable, "-I", "-B", "-c", _BOOT, str(PACKAGE_DIR), str(job), json.dumps(limits.rlimits())]
    return _wrap(job, worker, level)


def _wrap(job: Path, argv: list[str], level: str) -> list[str]:
    """``argv`` inside the namespaces of ``level`` (see the module docstring)."""
    unshare = shutil.which("unshare", path=_SAFE_PATH) or "unshare"
    if level == "namespaces":
        return [unshare, *_NS_FLAGS, "sh", "-c", _NS_SCRIPT, "sh", str(job), *argv]
    if level == "network":
        return [unshare, "--user", "--map-root-user", "--net", *argv]
    return list(argv)


def run_in_sandbox(source: str, features_path: str | os.PathLike | None = None, window: int = 64,
                   limits: SandboxLimits = SandboxLimits(), static_check: bool = True,
                   synthetic_seeds=(0, 1)) -> SandboxResult:
    """Stage 0 here, then stage 1 and the scoring of ``features_path`` (if given) in a sandboxed worker.

    Scores (float32, the features' keys, each of shape (b, h, n)) come back only with status "ok".
    Never raises because of the candidate; a missing or malformed features file is the caller's error.
    """
    start = time.perf_counter()

    def done(status: str, reason: str, scores=None, invariants=None) -> SandboxResult:
        return SandboxResult(status, reason[:MAX_REASON], time.perf_counter() - start, scores or {}, invariants or {})

    if static_check:
        try:
            check_source(source)
        except StaticCheckError as err:
            return done("rejected", str(err))
    expected = _expected_shapes(features_path) if features_path is not None else {}
    _sweep_orphans()
    job = Path(tempfile.mkdtemp(prefix=f"{_JOB_PREFIX}{os.getpid()}-")).resolve()
    try:
        try:
            (job / "program.py").write_text(source, encoding="utf-8")
        except UnicodeEncodeError:
            return done("error", "the source is not encodable as UTF-8")
        spec = {"window": int(window), "synthetic_seeds": [int(s) for s in synthetic_seeds],
                "features": str(Path(features_path).resolve()) if features_path is not None else None}
        (job / "job.json").write_text(json.dumps(spec))
        status, reason = _execute(job, limits)
        if status:
            return done(status, reason)
        return _collect(job, expected, done)
    finally:
        if os.environ.get("KVSIEVE_KEEP_SANDBOX") == "1":
            (job / "KEPT").touch()  # the orphan sweep leaves it alone
        else:
            shutil.rmtree(job, ignore_errors=True)


@lru_cache(maxsize=1)
def _sweep_orphans() -> None:
    """Once per process: remove job dirs left by parents that died (e.g. killed with SIGKILL mid-run)."""
    for path in Path(tempfile.gettempdir()).glob(f"{_JOB_PREFIX}*-*"):
        pid = path.name[len(_JOB_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or (path / "KEPT").exists():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (PermissionError, OverflowError):
            pass


def _execute(job: Path, limits: SandboxLimits) -> tuple[str, str]:
    """Run the worker; ("", "") when it exited normally (its result is then in the job dir)."""
    level = isolation_level()
    try:
        with open(job / "stderr.txt", "wb") as stderr:
            proc = subprocess.Popen(_command(job, limits, level), cwd=job, env=sandbox_env(job, limits.threads),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr,
                                    start_new_session=True, close_fds=True)
    except OSError as err:
        return "error", f"sandbox worker could not be started: {type(err).__name__}: {err}"
    try:
        started = _wait_ready(proc, limits.startup_s)
        if not started and not _exited(proc, 0):
            return "error", f"sandbox worker did not start within {limits.startup_s:g} s"
        if started and not _exited(proc, limits.timeout_s):
            return "killed", f"timed out after {limits.timeout_s:g} s"
    finally:
        _kill_group(proc)  # the leader is not reaped yet, so its group id cannot have been reused
        proc.wait()
        proc.stdout.close()
    code = proc.returncode
    sig = -code if code < 0 else code - 128 if level == "namespaces" and code > 128 else 0
    if sig:
        name = signal.Signals(sig).name if sig in signal.valid_signals() else str(sig)
        hint = {"SIGXCPU": " (CPU time limit)", "SIGXFSZ": " (file size limit)"}.get(name, "")
        return "killed", f"killed by signal {sig} ({name}){hint}"
    if level == "namespaces" and code in (97, 98):
        return "error", f"sandbox namespace setup failed (exit {code})"
    if code != 0 or not (job / "result.json").exists():
        return "error", f"sandbox worker exited with code {code} and no result: {_last_line(job / 'stderr.txt')}"
    return "", ""


def _wait_ready(proc: subprocess.Popen, timeout: float) -> bool:
    deadline, fd, seen = time.monotonic() + timeout, proc.stdout.fileno(), b""
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([fd], [], [], left)
        if not readable:
            return False
        chunk = os.read(fd, 64)
        if not chunk:
            return False  # EOF: the worker exited (or closed stdout) without starting the candidate
        seen += chunk
        if seen.startswith(_READY):
            return True
        if len(seen) >= len(_READY):
            return False
    return False


def _exited(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait for the worker to exit without reaping it (``WNOWAIT``), so its process group can still be
    killed safely afterwards."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
                return True
        except ChildProcessError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _last_line(path: Path) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, path.stat().st_size - 2000))
            lines = handle.read().decode("utf-8", "replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def _expected_shapes(features_path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Keys and (b, h, n) score shapes of a features file, read from its header only."""
    from safetensors import safe_open

    with safe_open(os.fspath(features_path), framework="pt") as handle:
        keys = json.loads(handle.metadata()["scalars"])
        return {key: tuple(handle.get_slice(f"{key}.key_norm").get_shape()) for key in keys}


def _collect(job: Path, expected: dict[str, tuple[int, ...]], done) -> SandboxResult:
    """Read and validate what the worker wrote; anything malformed is the candidate's failure."""
    path = job / "result.json"
    try:
        if path.stat().st_size > MAX_RESULT_BYTES:
            return done("error", "sandbox result is too large")
        result = json.loads(path.read_text())
        status, reason, invariants = result["status"], result["reason"], result["invariants"]
        if status not in ("ok", "invalid", "error", "killed") or not isinstance(reason, str) or not (
                isinstance(invariants, dict) and all(isinstance(v, bool) for v in invariants.values())):
            raise ValueError("malformed")
    except (OSError, ValueError, KeyError, TypeError):
        return done("error", "sandbox result is missing or malformed")
    invariants = {str(k): v for k, v in invariants.items()}
    if status != "ok":
        return done(status, reason, invariants=invariants)
    if not expected:
        return done("ok", "", invariants=invariants)
    scores, problem = _read_scores(job / "scores.safetensors", expected)
    if problem:
        return done("invalid", problem, invariants=invariants)
    return done("ok", "", scores, invariants)


def _read_scores(path: Path, expected: dict[str, tuple[int, ...]]) -> tuple[dict[str, torch.Tensor], str]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            keys = set(handle.keys())
            if keys != set(expected):
                missing, extra = sorted(set(expected) - keys), sorted(keys - set(expected))
                return {}, f"scores file keys differ: missing {missing[:5]}, unexpected {extra[:5]}"
            scores = {key: handle.get_tensor(key) for key in expected}
    except (OSError, SafetensorError) as err:
        return {}, f"scores file is missing or unreadable: {type(err).__name__}"
    for key, shape in expected.items():
        tensor = scores[key]
        if tensor.dtype != torch.float32 or tuple(tensor.shape) != shape:
            return {}, f"scores for {key!r}: expected float32 {shape}, got {tensor.dtype} {tuple(tensor.shape)}"
        if not bool(torch.isfinite(tensor).all()):
            return {}, f"scores for {key!r} are not all finite"
    return scores, ""
