"""Run an untrusted candidate program away from the process that holds the model.

Layers, outermost first (each one alone should stop a hostile program; together they make a
mistake in any one of them survivable). docs/security.md has the threat model and the table of
which hostile case each layer stops.

1. Stage 0 in this process: ``static_check.check_source`` (parsed and priced; nothing runs);
   ``static_check=False`` skips it, only so tests can show that the layers below hold alone.
2. The interpreter (``interpreter.py``) in the worker: the program is a typed graph, never Python; each call
   is priced from its shapes before its first operation runs.
3. A separate process (``worker.py``) with an environment built from scratch (:func:`sandbox_env`),
   in its own session, killed with its process group at the candidate's own deadline (:func:`candidate_deadline`:
   its predicted time, with a margin; an overrun is its failure) or, where nothing could price it, at the
   wall-clock guard, with kernel limits
   it sets on itself before importing anything (address space, file size, CPU seconds, open files,
   locked memory, message queues, no core dumps), a seccomp filter (``seccomp.py``: no sockets,
   memfd, fallocate, pidfd, process creation, signals to others) and an audit hook whose constants
   live in closures (``process_guards.install_guards``). Its results come back over a pipe, read here with
   a size cap and a deadline and parsed with a depth bound (it writes no file the parent opens).
4. Namespaces, probed once (:func:`isolation_level`):
   ``"full"``: new mount, PID, network, IPC and UTS namespaces (and a user namespace when this
   process is not root); the worker sees a minimal root: a small tmpfs with read-only binds of the
   Python installation, the virtualenv and the kvsieve package, ``/dev`` with only null, zero and
   urandom, its own ``/proc``, ``/job`` (the program, read-only) and a size- and inode-capped ``/tmp``;
   no ``$HOME``, no project folders. It runs as uid/gid 65534 without capabilities when this process
   is root (``setpriv``), else in a nested user namespace without capabilities.
   ``"network"``: only a user and a network namespace. ``"none"``: no unshare.
   ``KVSIEVE_SANDBOX_ISOLATION`` caps the level (for tests and debugging); ``require_isolation``
   refuses to run below ``"full"`` (``kvsieve evolve --sandbox strict``).

``KVSIEVE_KEEP_SANDBOX=1`` keeps the job directories for debugging.
"""

from __future__ import annotations

import json
import math
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from kvsieve.evolve import seccomp
from kvsieve.evolve.stage1_invariants import invariant_cases
from kvsieve.language.interpreter import ScoreProgram
from kvsieve.language.static_check import StaticCheckError, check_source

__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailable", "run_in_sandbox", "sandbox_env",
           "isolation_level", "isolation_report", "require_isolation", "STATUSES", "ISOLATION_LEVELS",
           "Deadline", "candidate_deadline", "job_prediction_s"]

STATUSES = ("ok", "rejected", "invalid", "error", "killed")
ISOLATION_LEVELS = ("none", "network", "full")
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # .../kvsieve
MIN_MEMORY_MB = 1024  # importing torch maps ~0.7 GB of address space (measured: 512 MB fails, 768 MB works)
MAX_REASON = 500
MAX_RESULT_BYTES = 1 << 20  # the JSON part of the worker's frame
MAX_JSON_DEPTH = 8
INFRA_RETRIES = 2
NOBODY = 65534
_READY = b"ready\n"
_SETUP_FAILED = b"setup-failed\n"
_JOB_PREFIX = "kvsieve-sandbox-"
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
_JOB_INSIDE = "/job"

# Run by unshare as PID 1 of the new namespaces (as root there): build the minimal root under
# $job/root, then chroot into it and drop to the unprivileged user (``$drop``). Arguments: job dir,
# scratch MiB, the drop command, the paths to bind read-only, "--", the worker's argv.
_FULL_SCRIPT = r"""
set -eu
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
job=$1; mb=$2; drop=$3; shift 3
r="$job/root"
mount -t tmpfs -o size=4m,nr_inodes=4096,mode=755,nosuid,nodev kvsieve-root "$r" || exit 97
mkdir -p "$r/dev" "$r/proc" "$r/tmp" "$r/job"
# the scratch /tmp first: a virtualenv or checkout that lives under /tmp is bound on top of it, not hidden
mount -t tmpfs -o size="$mb"m,nr_inodes=64,mode=1777,nosuid,nodev,noexec kvsieve-tmp "$r/tmp" || exit 97
while [ "$1" != "--" ]; do
  p=$1; shift
  [ -e "$p" ] || continue
  if [ -d "$p" ]; then mkdir -p "$r$p"; else mkdir -p "$r$(dirname "$p")"; : > "$r$p"; fi
  mount --bind "$p" "$r$p" && mount -o remount,bind,ro,nosuid,nodev "$r$p" || exit 97
done
shift
for l in bin sbin lib lib64; do
  if [ -L "/$l" ]; then ln -s "$(readlink "/$l")" "$r/$l"; fi
done
for d in null zero urandom; do
  : > "$r/dev/$d"; mount --bind "/dev/$d" "$r/dev/$d" || exit 97
done
mount -t proc -o nosuid,nodev,noexec proc "$r/proc" 2>/dev/null || true
mount --bind "$job/in" "$r/job" && mount -o remount,bind,ro,nosuid,nodev "$r/job" || exit 97
mount -o remount,ro,nosuid,nodev "$r" || exit 97
exec chroot "$r" $drop "$@"
"""
_NS_FLAGS = ("--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child")
_DROP_ROOT = (f"/usr/bin/setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups --inh-caps=-all "
              "--bounding-set=-all --no-new-privs")
_DROP_USERNS = "/usr/bin/unshare --user"

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
code = main(sys.argv[2], int(sys.argv[4]))
sys.stdout.flush()
os._exit(code)
"""


# What the worker does for a candidate besides interpreting it, priced like the program (and with the same margin):
# each stage-1 case makes its synthetic features twice, clones and compares them and runs the selection (measured:
# 40-65 ns per b h g (window + 1) n element, 2-core AMD EPYC, one thread), each scored features key is copied,
# checked and serialised, and every call has its Python overhead.
HARNESS_NS_PER_CASE_ELEMENT = 100.0
HARNESS_NS_PER_SCORE_ELEMENT = 20.0
HARNESS_NS_PER_CALL = 2e6


class SandboxUnavailable(RuntimeError):
    """The sandbox itself failed (not the candidate), after retries; or the isolation asked for is missing."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run.

    ``timeout_s`` is wall-clock time for the candidate (compiling it, the invariants, the scoring),
    counted once the worker has started; ``startup_s`` bounds the start-up before that (spawn, torch
    import, reading the features), which is not the candidate's doing. ``memory_mb`` is the worker's
    address-space limit (at least 1024: torch alone maps ~0.7 GB).

    A candidate the parent can price (its text is a program of the language) gets its own deadline
    (:func:`candidate_deadline`): ``deadline_margin`` x the predicted time of everything the worker does for it
    (:func:`job_prediction_s`: its calls in stage 1 and on the features, and the worker's own work around them) +
    ``deadline_slack_s``, at most ``timeout_s``. A run past it is the candidate's failure ("killed", with the
    predicted and measured times in the reason), never retried: the cost model promised the time, and a program
    that takes ten times its price found a slow path the model does not know. Only a run nothing could price (stage
    0 skipped and the text outside the language: the tests' raw loader) keeps ``timeout_s`` as a pure
    infrastructure guard: its hit (and the CPU-seconds rlimit's) is retried (``INFRA_RETRIES``) and then raises
    :class:`SandboxUnavailable`.
    """

    timeout_s: float = 120.0
    memory_mb: int = 4096
    threads: int = 1
    file_mb: int = 256
    startup_s: float = 60.0
    deadline_margin: float = 10.0
    deadline_slack_s: float = 5.0

    def __post_init__(self) -> None:
        if not (self.timeout_s > 0 and self.startup_s > 0):
            raise ValueError(f"timeout_s and startup_s must be > 0, got {self.timeout_s}, {self.startup_s}")
        if not (self.deadline_margin > 0 and self.deadline_slack_s >= 0):
            raise ValueError(f"deadline_margin must be > 0 and deadline_slack_s >= 0, got {self.deadline_margin}, "
                             f"{self.deadline_slack_s}")
        if self.memory_mb < MIN_MEMORY_MB:
            raise ValueError(f"memory_mb={self.memory_mb} is below {MIN_MEMORY_MB}: torch cannot even be imported")
        if self.threads < 1 or self.file_mb < 1:
            raise ValueError(f"threads and file_mb must be >= 1, got {self.threads}, {self.file_mb}")

    def rlimits(self) -> dict[str, tuple[int, int]]:
        # CPU seconds past the wall clock's kill: the deadline (at most timeout_s) always comes first
        cpu = math.ceil((self.startup_s + self.timeout_s) * self.threads) + 1
        return {"RLIMIT_AS": (self.memory_mb << 20,) * 2, "RLIMIT_FSIZE": (self.file_mb << 20,) * 2,
                "RLIMIT_CPU": (cpu, cpu + 1), "RLIMIT_CORE": (0, 0), "RLIMIT_NOFILE": (64, 64),
                "RLIMIT_MEMLOCK": (0, 0), "RLIMIT_MSGQUEUE": (0, 0)}


@dataclass
class SandboxResult:
    """``status``: "ok", "rejected" (stage 0), "invalid" (stage 1 or bad outputs), "error" (the candidate
    raised) or "killed" (timeout, a limit, memory, signal). ``scores`` only when "ok". ``isolation``
    is the level it ran at, with ``+seccomp`` when the worker reported the filter in place."""

    status: str
    reason: str
    seconds: float
    scores: dict[str, torch.Tensor] = field(default_factory=dict)
    invariants: dict[str, bool] = field(default_factory=dict)
    isolation: str = ""
    work_growth: str = ""  # stage 1's measure of the program's work at n and 2n (interpreter.work_growth)


@dataclass(frozen=True)
class Deadline:
    """A candidate's own deadline: ``seconds`` after its start, from ``predicted_s`` (:func:`job_prediction_s`)
    x ``margin`` + ``slack_s``, at most the sandbox's ``timeout_s`` (``capped``)."""

    seconds: float
    predicted_s: float
    margin: float
    slack_s: float
    capped: bool = False

    def reason(self, measured_s: float) -> str:
        rule = f"{self.margin:g} x predicted + {self.slack_s:g} s"
        if self.capped:
            rule += ", capped at the sandbox's timeout"
        return (f"ran past its deadline: killed after {measured_s:.2f} s, against {self.predicted_s:.3f} s predicted "
                f"for its stage 1 and scoring (deadline {self.seconds:.2f} s = {rule}): the run took far longer than "
                "its price")


def job_prediction_s(program: ScoreProgram, window: int, seeds, feature_dims: dict[str, tuple[int, int, int, int]]
                     ) -> float:
    """The predicted seconds the worker spends on ``program`` after its start: stage 1's cases
    (``stage1_invariants.invariant_cases``, each scored twice, at the synthetic shapes and at the features' own
    (b, h, g, n)) and each features key scored once, priced by the cost model, plus the worker's own work around
    them (``HARNESS_*``)."""
    shapes = list(feature_dims.values())
    total = 0.0
    for case in invariant_cases(int(window), list(seeds), shapes):
        b, h, g, n = case["batch"], case["kv_heads"], case["group"], case["n"]
        total += 2 * (program.predict(b, h, g, n).total_ns + HARNESS_NS_PER_CALL)
        total += HARNESS_NS_PER_CASE_ELEMENT * b * h * g * (int(window) + 1) * n
    for b, h, g, n in shapes:
        total += program.predict(b, h, g, n).total_ns + HARNESS_NS_PER_CALL + HARNESS_NS_PER_SCORE_ELEMENT * b * h * n
    return total / 1e9


def candidate_deadline(program: ScoreProgram, window: int, seeds, feature_dims: dict[str, tuple[int, int, int, int]],
                       limits: SandboxLimits) -> Deadline:
    """The seconds a priced candidate may run in the worker before it is killed as its own failure."""
    predicted = job_prediction_s(program, window, seeds, feature_dims)
    seconds = limits.deadline_margin * predicted + limits.deadline_slack_s
    return Deadline(min(seconds, limits.timeout_s), predicted, limits.deadline_margin, limits.deadline_slack_s,
                    capped=seconds > limits.timeout_s)


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
    cap = os.environ.get("KVSIEVE_SANDBOX_ISOLATION", "full")
    if cap not in ISOLATION_LEVELS:
        raise ValueError(f"KVSIEVE_SANDBOX_ISOLATION={cap!r} is not one of {ISOLATION_LEVELS}")
    return min(_probe(), cap, key=ISOLATION_LEVELS.index)


def isolation_report() -> dict:
    """What the sandbox can do here: the level, the seccomp filter, the uid the worker runs as, and
    what is given up below ``"full"`` (printed by ``kvsieve evolve`` and stored in its database)."""
    level = isolation_level()
    root = os.geteuid() == 0
    uid = (f"{NOBODY} (setpriv)" if root else f"{os.geteuid()} in a nested user namespace") if level == "full" \
        else f"{os.geteuid()} (this process's{', root' if root else ''})"
    missing = {"full": [], "network": ["minimal root (the worker can read what this process can read)",
                                       "PID namespace (it can see and signal this process's processes "
                                       "but for seccomp)", "unprivileged uid"],
               "none": ["every namespace: the network is refused by seccomp and the audit hook only",
                        "minimal root", "unprivileged uid"]}[level]
    return dict(level=level, seccomp=seccomp.supported(), worker_uid=uid, missing=missing,
                full=level == "full" and seccomp.supported())


def require_isolation(mode: str) -> dict:
    """``mode`` "strict": refuse (SandboxUnavailable) unless the isolation is full; "default": warn on
    stderr when it is weaker. Returns :func:`isolation_report`."""
    if mode not in ("default", "strict"):
        raise ValueError(f"sandbox mode must be 'default' or 'strict', got {mode!r}")
    report = isolation_report()
    if not report["full"]:
        text = (f"sandbox isolation here is {report['level']!r}"
                f"{'' if report['seccomp'] else ' without a seccomp filter'}, not 'full': "
                f"{'; '.join(report['missing']) or 'no seccomp filter on this architecture'}")
        if mode == "strict":
            raise SandboxUnavailable(f"--sandbox strict: {text}")
        print(f"kvsieve: WARNING: {text} (docs/security.md)", file=sys.stderr)
    return report


@lru_cache(maxsize=1)
def _probe() -> str:
    unshare = shutil.which("unshare", path=_SAFE_PATH)
    if not unshare:
        return "none"
    with tempfile.TemporaryDirectory(prefix="kvsieve-probe-") as tmp:
        job = Path(tmp, "job")
        _make_job_dirs(job)
        secret = Path(tmp, "secret")
        secret.write_text("x")
        # inside: the scratch is writable, the job dir is not, this folder does not exist, /dev is minimal
        check = ["/bin/sh", "-c", f'echo ok > /tmp/in && ! echo x > /job/out 2>/dev/null && [ ! -e "{tmp}" ] '
                 '&& [ ! -e /dev/sda ] && [ -e /dev/null ] && [ "$(id -u)" != 0 ]']
        if _quiet(_wrap(job, check, "full", 4), None):
            return "full"
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


def _make_job_dirs(job: Path) -> None:
    """``job/in`` (read by the worker: program, job spec) and ``job/root`` (the mount point of its root)."""
    job.mkdir(exist_ok=True)
    for name in ("in", "root"):
        (job / name).mkdir()
        (job / name).chmod(0o755)


def _binds() -> list[str]:
    """What the worker's minimal root holds, read-only: the system's programs and libraries, the Python
    installation, the virtualenv, kvsieve, the CPU description torch reads."""
    paths = ["/usr", "/etc/ld.so.cache", sys.base_prefix, sys.prefix, str(PACKAGE_DIR), "/sys/devices/system/cpu"]
    for name in ("bin", "sbin", "lib", "lib64"):
        if not os.path.islink(f"/{name}") and os.path.isdir(f"/{name}"):
            paths.append(f"/{name}")
    real = list(dict.fromkeys(os.path.realpath(p) if p != "/etc/ld.so.cache" else p for p in paths))
    # The worker is started as sys.executable, by the path as given: a virtualenv reached through a symlink
    # (a linked folder above it) must exist at that path in the minimal root too, so what the path resolves
    # to is bound there as well (mount follows the link; the mount point is a plain folder in the new root).
    aliases: list[str] = []
    for path in (sys.prefix, os.path.dirname(sys.executable)):
        alias = os.path.abspath(path)
        if os.path.realpath(alias) != alias and not any(alias == b or alias.startswith(b.rstrip("/") + "/")
                                                        for b in (*real, *aliases)):
            aliases.append(alias)
    return real + aliases


def _wrap(job: Path, argv: list[str], level: str, scratch_mb: int) -> list[str]:
    """``argv`` inside the namespaces of ``level`` (see the module docstring)."""
    unshare = shutil.which("unshare", path=_SAFE_PATH) or "unshare"
    if level == "full":
        root = os.geteuid() == 0
        flags = _NS_FLAGS if root else ("--user", "--map-root-user", *_NS_FLAGS)
        return [unshare, *flags, "/bin/sh", "-c", _FULL_SCRIPT, "sh", str(job), str(int(scratch_mb)),
                _DROP_ROOT if root else _DROP_USERNS, *_binds(), "--", *argv]
    if level == "network":
        return [unshare, "--user", "--map-root-user", "--net", *argv]
    return list(argv)


def run_in_sandbox(source: str, features_path: str | os.PathLike | None = None, window: int = 64,
                   limits: SandboxLimits = SandboxLimits(), static_check: bool = True,
                   synthetic_seeds=(0, 1), layers: dict | None = None) -> SandboxResult:
    """Stage 0 here, then stage 1 and the scoring of ``features_path`` (if given) in a sandboxed worker.

    Scores (float32, the features' keys, each of shape (b, h, n)) come back only with status "ok".
    Never raises because of the candidate: whatever stage 0 raises on its text is a rejection, and a run past the
    candidate's own deadline (:func:`candidate_deadline`) is "killed" with the predicted and measured times; a
    sandbox that fails to start (or an unpriced run past the wall-clock guard) is retried (``INFRA_RETRIES``) and
    then raises :class:`SandboxUnavailable`, so that an infrastructure failure is never recorded as the candidate's.
    A missing or malformed features file is the caller's error.
    ``layers`` (tests only) turns parts of the process layer off: ``{"seccomp": False, "audit_hook":
    False, "raw_loader": PATH}``, the last running the program as Python through a trusted loader file
    instead of the interpreter, so that the process layer can be shown to hold alone.
    """
    start = time.perf_counter()

    def done(status: str, reason: str, scores=None, invariants=None, isolation="") -> SandboxResult:
        return SandboxResult(status, reason[:MAX_REASON], time.perf_counter() - start, scores or {}, invariants or {},
                             isolation)

    program: ScoreProgram | None = None
    try:
        program = check_source(source)
    except StaticCheckError as err:
        if static_check:
            return done("rejected", str(err))
    except Exception as err:  # noqa: BLE001 - stage 0 reads the candidate's text: whatever it raises is a refusal
        if static_check:
            return done("rejected", f"program: stage 0 cannot read it: {type(err).__name__}")
    dims = _feature_dims(features_path) if features_path is not None else {}
    expected = {key: (b, h, n) for key, (b, h, g, n) in dims.items()}
    # a program of the language has a price, and so a deadline of its own (static_check=False still prices it)
    deadline = candidate_deadline(program, window, synthetic_seeds, dims, limits) if program is not None else None
    _sweep_orphans()
    problem = ""
    for _ in range(1 + INFRA_RETRIES):
        outcome = _attempt(source, features_path, window, limits, synthetic_seeds, layers or {}, expected, done,
                           deadline)
        if isinstance(outcome, SandboxResult):
            return outcome
        problem = outcome
    raise SandboxUnavailable(f"the sandbox failed {1 + INFRA_RETRIES} times, not because of the candidate: {problem}")


def _attempt(source, features_path, window, limits, seeds, layers, expected, done,
             deadline: Deadline | None = None) -> SandboxResult | str:
    """One sandboxed run: its result, or why the sandbox itself failed (a str)."""
    level = isolation_level()
    job = Path(tempfile.mkdtemp(prefix=f"{_JOB_PREFIX}{os.getpid()}-")).resolve()
    features_fd = -1
    try:
        _make_job_dirs(job)
        try:
            data = source.encode("utf-8")
        except UnicodeEncodeError:
            return done("error", "the source is not encodable as UTF-8")
        (job / "in" / "program.py").write_bytes(data)
        # the interpreter runs without a wall-clock deadline of its own: the parent kills the worker at the
        # candidate's deadline (its price with a margin), or at the wall-clock guard where nothing priced it
        spec = {"window": int(window), "synthetic_seeds": [int(s) for s in seeds],
                "limits": {"deadline_s": None}, "seccomp": layers.get("seccomp", True),
                "audit_hook": layers.get("audit_hook", True)}
        if layers.get("raw_loader"):
            shutil.copyfile(layers["raw_loader"], job / "in" / "loader.py")
            spec["raw_loader"] = "loader.py"
        (job / "in" / "job.json").write_text(json.dumps(spec))
        for path in (job / "in").iterdir():
            path.chmod(0o644)
        if features_path is not None:
            features_fd = os.open(os.fspath(features_path), os.O_RDONLY | os.O_CLOEXEC)
        inside = _JOB_INSIDE if level == "full" else str(job / "in")
        worker = [sys.executable, "-I", "-B", "-c", _BOOT, str(PACKAGE_DIR), inside, json.dumps(limits.rlimits()),
                  str(features_fd)]
        env = sandbox_env("/tmp" if level == "full" else job / "in", limits.threads)
        cap = MAX_RESULT_BYTES + 16 + sum(4 * math.prod(s) for s in expected.values()) + 64 * (len(expected) + 1)
        outcome = _execute(_wrap(job, worker, level, limits.file_mb), job, env, limits, features_fd, cap, deadline)
        if isinstance(outcome, str):
            return outcome
        status, reason, frame = outcome
        if status:
            return done(status, reason, isolation=level)
        return _collect(frame, expected, done, level)
    finally:
        if features_fd >= 0:
            os.close(features_fd)
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


def _execute(cmd: list[str], job: Path, env: dict, limits: SandboxLimits, features_fd: int, cap: int,
             candidate: Deadline | None = None) -> tuple[str, str, bytes] | str:
    """Run the worker and read its stdout (capped at ``cap`` bytes, with deadlines) and stderr (its tail).

    Returns ``(status, reason, frame)``: status "" when the worker ran the candidate and exited, with
    the frame it wrote after the ready line; "killed" when it ran past ``candidate`` (its own deadline); or a str
    when the sandbox itself failed (retried).
    """
    try:
        proc = subprocess.Popen(cmd, cwd=job, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
                                pass_fds=(features_fd,) if features_fd >= 0 else ())
    except OSError as err:
        return f"sandbox worker could not be started: {type(err).__name__}: {err}"
    out, err_tail, started, over = bytearray(), b"", False, False
    ran_from = 0.0
    deadline = time.monotonic() + limits.startup_s
    open_fds = {proc.stdout.fileno(): "out", proc.stderr.fileno(): "err"}
    timed_out = False
    try:
        while open_fds:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            readable, _, _ = select.select(list(open_fds), [], [], min(left, 1.0))
            for fd in readable:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    del open_fds[fd]
                elif open_fds[fd] == "err":
                    err_tail = (err_tail + chunk)[-2000:]
                else:
                    out += chunk
                    if len(out) > cap + len(_READY):
                        over = True
                        break
                    if not started and out.startswith(_READY):
                        started = True
                        ran_from = time.monotonic()  # the candidate's time starts now
                        deadline = ran_from + (candidate.seconds if candidate is not None else limits.timeout_s)
            if over:
                break
        if not timed_out and not over:
            _exited(proc, max(0.0, deadline - time.monotonic()))
    finally:
        _kill_group(proc)  # the leader is not reaped yet, so its group id cannot have been reused
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    last = _last_line(err_tail)
    if not started:
        if out.startswith(_SETUP_FAILED):
            return f"sandbox worker setup failed: {bytes(out[len(_SETUP_FAILED):])[:300]!r}"
        if timed_out:
            return f"sandbox worker did not start within {limits.startup_s:g} s: {last}"
        code = proc.returncode
        return f"sandbox worker exited with code {code} before the candidate started: {last}"
    if over:
        return "killed", f"the worker wrote more than {cap} bytes of results", b""
    if timed_out and candidate is not None:  # its own deadline: the candidate's failure, never retried
        return "killed", candidate.reason(time.monotonic() - ran_from), b""
    if timed_out:  # nothing priced it: a guard, not the candidate's result; the caller retries (docs: SandboxLimits)
        return f"the candidate's run passed the wall-clock guard of {limits.timeout_s:g} s"
    code = proc.returncode
    level_ns = cmd and os.path.basename(cmd[0]) == "unshare" and "--kill-child" in cmd
    sig = -code if code < 0 else code - 128 if level_ns and code > 128 else 0
    if sig:
        name = signal.Signals(sig).name if sig in signal.valid_signals() else str(sig)
        if name == "SIGXCPU":  # CPU seconds follow the wall-clock guard: a guard too, retried
            return f"the worker passed the CPU-time guard of {limits.rlimits()['RLIMIT_CPU'][0]} s"
        hint = {"SIGXFSZ": " (file size limit)"}.get(name, "")
        return "killed", f"killed by signal {sig} ({name}){hint}", b""
    if code != 0:
        return "error", f"sandbox worker exited with code {code}: {last}", b""
    return "", "", bytes(out[len(_READY):])


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


def _last_line(data: bytes) -> str:
    lines = data.decode("utf-8", "replace").strip().splitlines()
    return lines[-1][:300] if lines else ""


def _feature_dims(features_path: str | os.PathLike) -> dict[str, tuple[int, int, int, int]]:
    """Keys and (b, h, g, n) of a features file (its ``attn``), read from its header only."""
    from safetensors import safe_open

    with safe_open(os.fspath(features_path), framework="pt") as handle:
        keys = json.loads(handle.metadata()["scalars"])
        return {key: tuple(int(d) for d in handle.get_slice(f"{key}.attn").get_shape()) for key in keys}


def json_depth_ok(data: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the brackets of a JSON text nest at most ``limit`` deep (strings skipped), so that
    ``json.loads`` cannot recurse out of the parent on ``[[[[...``."""
    depth, in_string, escaped = 0, False, False
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            if depth > limit:
                return False
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return True


def _collect(frame: bytes, expected: dict[str, tuple[int, ...]], done, level: str) -> SandboxResult:
    """Parse and validate the worker's frame; anything malformed is the candidate's failure."""
    try:
        (size,) = struct.unpack("<Q", frame[:8])
        if size > MAX_RESULT_BYTES or len(frame) < 16 + size:
            raise ValueError("size")
        text = frame[8:8 + size]
        if not json_depth_ok(text):
            return done("error", f"sandbox result nests deeper than {MAX_JSON_DEPTH}", isolation=level)
        result = json.loads(text)
        status, reason, invariants = result["status"], result["reason"], result["invariants"]
        if status not in ("ok", "invalid", "error", "killed") or not isinstance(reason, str) or not (
                isinstance(invariants, dict) and all(isinstance(v, bool) for v in invariants.values())):
            raise ValueError("malformed")
        (scores_size,) = struct.unpack("<Q", frame[8 + size:16 + size])
        scores_bytes = frame[16 + size:]
        if scores_size != len(scores_bytes):
            raise ValueError("scores size")
    except (ValueError, KeyError, TypeError, struct.error, UnicodeDecodeError):
        return done("error", "sandbox result is missing or malformed", isolation=level)
    isolation = level + ("+seccomp" if result.get("seccomp") == "on" else "")
    invariants = {str(k): v for k, v in invariants.items()}
    growth = result.get("work_growth")
    growth = growth[:MAX_REASON] if isinstance(growth, str) else ""

    def finished(*args, **kwargs) -> SandboxResult:
        out = done(*args, **kwargs)
        out.work_growth = growth
        return out

    if status != "ok":
        return finished(status, reason, invariants=invariants, isolation=isolation)
    if not expected:
        return finished("ok", "", invariants=invariants, isolation=isolation)
    scores, problem = _read_scores(scores_bytes, expected)
    if problem:
        return finished("invalid", problem, invariants=invariants, isolation=isolation)
    return finished("ok", "", scores, invariants, isolation)


def _read_scores(data: bytes, expected: dict[str, tuple[int, ...]]) -> tuple[dict[str, torch.Tensor], str]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        scores = load(data)
    except (SafetensorError, ValueError, OSError) as err:
        return {}, f"scores are missing or unreadable: {type(err).__name__}"
    if set(scores) != set(expected):
        missing, extra = sorted(set(expected) - set(scores)), sorted(set(scores) - set(expected))
        return {}, f"scores keys differ: missing {missing[:5]}, unexpected {extra[:5]}"
    for key, shape in expected.items():
        tensor = scores[key]
        if tensor.dtype != torch.float32 or tuple(tensor.shape) != shape:
            return {}, f"scores for {key!r}: expected float32 {shape}, got {tensor.dtype} {tuple(tensor.shape)}"
        if not bool(torch.isfinite(tensor).all()):
            return {}, f"scores for {key!r} are not all finite"
    return scores, ""
