"""The sandboxed side: interprets one candidate in its own process (started by ``sandbox.py``).

The job directory holds ``job.json`` (``window``, ``synthetic_seeds``, the interpreter's limits) and
``program.py``; the features come as an open file descriptor (so the worker needs no path to them).
Order matters: torch, the kvsieve modules and the features are loaded first; then torch's and
numpy's unaudited native file I/O is removed, the seccomp filter (``seccomp.py``) and the audit
hook go in, and only then is the candidate parsed and interpreted (``interpreter.py``: no candidate
code runs as Python). It runs the stage-1 invariants on synthetic features and on the real
features' shapes, scores the features, and writes one frame to stdout after the ready line:
``u64 length, JSON result, u64 length, safetensors scores``. It writes no file: the parent reads
the pipe with a size cap and a deadline and validates everything (``sandbox.py``).
"""

from __future__ import annotations

import json
import os
import struct
import sys
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from kvsieve.evolve import seccomp
from kvsieve.language import operations
from kvsieve.language.interpreter import (
    MAX_WORK_EXPONENT,
    InterpreterError,
    LimitExceeded,
    Limits,
    ScoreProgram,
    work_growth,
)
from kvsieve.language.program_features import TENSOR_FIELDS, Features, synthetic_features
from kvsieve.language.program_source import Program, ProgramError
from kvsieve.selection import ALLOCATIONS, Selection

__all__ = ["check_invariants", "install_guards", "invariant_cases", "main", "INVARIANTS", "features_from_bytes",
           "remove_native_io"]

INVARIANTS = ("tensor", "float", "shape", "finite", "inputs_unchanged", "deterministic", "budget")
READY = b"ready\n"
SETUP_FAILED = b"setup-failed\n"  # before the ready line: the sandbox's failure, never the candidate's
MAX_REASON = 300


def invariant_cases(window: int, seeds: Iterable[int], real_shapes: Iterable[tuple[int, ...]] = ()) -> list[dict]:
    """Synthetic feature shapes for stage 1: one and three query heads, a context just above the window
    and a longer one (so both ends of the budget range and the chunk grid are exercised), and then the
    dev features' own (b, h, g, n) shapes with synthetic values, so a program cannot tell stage 1's
    inputs from the dev set's by their shape."""
    cases = []
    for seed in seeds:
        cases.append(dict(seed=int(seed), batch=1, kv_heads=2, group=1, n=window + 5, window=window, layer=0.0))
        cases.append(dict(seed=int(seed), batch=2, kv_heads=2, group=3, n=4 * window + 37, window=window, layer=0.6))
    for b, h, g, n in sorted(set(real_shapes)):
        cases.append(dict(seed=int(next(iter(seeds), 0)), batch=b, kv_heads=h, group=g, n=n, window=window,
                          layer=0.5))
    return cases


def check_invariants(score_fn: Callable[[Features], object], program: Program, window: int,
                     seeds: Iterable[int] = (0, 1), real_shapes: Iterable[tuple[int, ...]] = ()
                     ) -> tuple[dict[str, bool], str]:
    """Stage 1: run ``score_fn`` on synthetic features and check the contract.

    Returns ``(invariants, reason)``: the checks that ran, in :data:`INVARIANTS` order, each ``True``
    or ``False``, stopping at the first failure, which ``reason`` names with its case ("" when all
    hold). Exceptions raised by ``score_fn`` propagate (the caller reports them as errors).
    """
    results: dict[str, bool] = {}
    selection = program.selection(window)

    def verdict(name: str, ok: bool) -> bool:
        results[name] = results.get(name, True) and bool(ok)
        return bool(ok)

    for case in invariant_cases(window, seeds, real_shapes):
        label = f"seed {case['seed']}, group {case['group']}, n {case['n']}"
        features = synthetic_features(**case)
        before = {name: t.clone() for name, t in features.tensors().items()}
        scalars = features.scalars()
        out = score_fn(features)
        for name in INVARIANTS:
            if not verdict(name, _holds(name, out, features, before, scalars, score_fn, case, selection)):
                detail = f" (got {_describe(out)})" if name in ("tensor", "float", "shape") else ""
                return results, f"invariant {name!r} fails on synthetic features ({label}){detail}"
    return results, ""


def _holds(name: str, out, features: Features, before, scalars, score_fn, case: dict, selection) -> bool:
    if name == "tensor":
        return type(out) is torch.Tensor
    if name == "float":
        return out.is_floating_point()
    if name == "shape":
        return tuple(out.shape) == features.score_shape
    if name == "finite":
        return bool(torch.isfinite(out).all())
    if name == "inputs_unchanged":
        return _unchanged(features, before, scalars)
    if name == "deterministic":
        return _same_again(score_fn, case, out)
    return _within_budget(selection, out, features.n)


def _unchanged(features: Features, before: dict[str, torch.Tensor], scalars: dict) -> bool:
    now = features.tensors()
    return features.scalars() == scalars and all(
        type(now[k]) is torch.Tensor and now[k].shape == v.shape and torch.equal(now[k], v) for k, v in before.items())


def _same_again(score_fn, case: dict, first: torch.Tensor) -> bool:
    again = score_fn(synthetic_features(**case))
    return type(again) is torch.Tensor and again.dtype == first.dtype and torch.equal(again, first)


def _within_budget(selection, scores: torch.Tensor, n: int) -> bool:
    """Distinct in-range entries within the budget, at a tight and a loose budget: at most ``kept`` per head
    (uniform allocation), or at most ``kept`` times the heads per batch row when the budget moves between heads
    (``allocation`` "layer" or "global", which within one layer's scores is "layer"; a head may then keep more
    than ``kept``). (Whether the selection's protected entries fit the dev set's real budgets is checked in the
    parent, before the candidate runs: ``evaluate.selection_problem``.)"""
    protected = int(selection.protected_mask(n, n).sum())
    for kept in sorted({min(n, protected + 1), min(n, protected + (n - protected) // 2)}):
        indices, valid = selection.kept_indices(scores.detach().float(), kept)
        counts = valid.sum(-1) if valid is not None else torch.full(indices.shape[:-1], indices.shape[-1])
        if selection.allocation == "uniform":
            over = bool((counts > kept).any())
        else:
            over = bool((counts.sum(-1) > kept * indices.shape[1]).any())
        if over or (indices.numel() and (indices.min() < 0 or indices.max() >= n)):
            return False
        if indices.shape[-1] > 1 and not bool((indices.diff(dim=-1) > 0).all()):
            return False
    return True


def _describe(out: object) -> str:
    if type(out) is torch.Tensor:
        return f"{out.dtype} tensor of shape {tuple(out.shape)}"
    return type(out).__name__


def _short(err: BaseException) -> str:
    """``Type: message`` cut short; no traceback, so no paths of this machine leak into the reason."""
    try:
        text = str(err)
    except Exception:  # noqa: BLE001 - a hostile __str__
        text = ""
    text = " ".join(text.split())
    return f"{type(err).__name__}: {text}"[:MAX_REASON] if text else type(err).__name__


# --- guards -----------------------------------------------------------------------------------------

_DENIED_PREFIXES = ("socket.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty",
                    "os.system", "os.kill", "os.killpg", "os.putenv", "os.unsetenv", "os.set", "os.chroot",
                    "os.chdir", "os.memfd", "os.pidfd", "os.posix_fallocate", "ctypes.", "pty.", "signal.",
                    "resource.", "mmap.", "sys._getframe", "sys._current_frames", "sys.setprofile",
                    "sys.settrace", "gc.get_", "object.__getattr__", "object.__setattr__", "object.__delattr__",
                    "function.__new__", "code.__new__", "cpython.", "marshal.", "pickle.", "import", "urllib.",
                    "http.", "ftplib.", "smtplib.", "webbrowser.", "shutil.", "winreg.", "syslog.", "sqlite3.",
                    "fcntl.", "sys.addaudithook", "builtins.input", "tempfile.", "compile", "exec")
_PATH_EVENTS = {"open": 1, "os.remove": 1, "os.rename": 2, "os.mkdir": 1, "os.rmdir": 1, "os.chmod": 1,
                "os.chown": 1, "os.symlink": 2, "os.link": 2, "os.truncate": 1, "os.utime": 1, "os.listdir": 1,
                "os.scandir": 1, "os.mkfifo": 1, "os.mknod": 1, "os.chflags": 1, "os.lchflags": 1,
                "os.setxattr": 1, "os.removexattr": 1, "os.listxattr": 1, "os.getxattr": 1, "glob.glob": 1}
# Native file I/O that raises no audit event: removed from torch and numpy before the candidate runs.
_NATIVE_IO = {"torch": ("from_file", "load", "save"), "torch.jit": ("load", "save"), "torch.hub": ("load",
              "load_state_dict_from_url", "download_url_to_file"), "torch.UntypedStorage": ("from_file",),
              "torch.TypedStorage": ("from_file",),
              "numpy": ("fromfile", "load", "save", "savez", "memmap", "loadtxt", "savetxt", "genfromtxt")}


class GuardViolation(PermissionError):
    """Raised by the audit hook; the message names the refused event."""


def remove_native_io() -> list[str]:
    """Replace the listed torch/numpy functions by refusals (only this process, after its own use of them).

    The interpreter never reaches them (they are not in its tables); this is for the process layer
    alone, when a program somehow runs as Python. Returns what was replaced.
    """
    removed = []

    def refusal(name: str):
        def refuse(*args, **kwargs):
            raise GuardViolation(f"sandbox: {name} is not allowed")
        return refuse

    native = sys.modules.get("torch._C")
    table = dict(_NATIVE_IO)
    if native is not None:  # torch._C's own readers and writers of files (TorchScript, mobile, pickles)
        table["torch._C"] = tuple(n for n in dir(native) if any(
            w in n.lower() for w in ("load", "from_file", "save", "import_ir", "_file", "pickle")))
    for owner_name, attrs in table.items():
        module_name, _, cls = owner_name.rpartition(".") if owner_name.count(".") else (owner_name, "", "")
        owner = sys.modules.get(owner_name) or (getattr(sys.modules.get(module_name), cls, None) if cls else None)
        if owner is None:
            continue
        for attr in attrs:
            if not hasattr(owner, attr):
                continue
            try:
                setattr(owner, attr, refusal(f"{owner_name}.{attr}"))
                removed.append(f"{owner_name}.{attr}")
            except (AttributeError, TypeError):  # a C type's attribute
                continue
    for name in [m for m in sys.modules if m.startswith(("torch.serialization", "torch.hub", "numpy.lib.npyio"))]:
        module = sys.modules[name]
        for attr in ("load", "save", "fromfile", "_load", "_save"):
            if hasattr(module, attr):
                setattr(module, attr, refusal(f"{name}.{attr}"))
    return removed


def _private_realpath():
    """A copy of ``posixpath.realpath`` whose globals and ``os`` functions are frozen now: a program that
    patches ``posixpath._joinrealpath`` or ``os.lstat`` later does not change what the guard resolves."""
    import posixpath
    import stat
    from types import FunctionType, SimpleNamespace

    namespace = dict(vars(posixpath))
    namespace["os"] = SimpleNamespace(fspath=os.fspath, lstat=os.lstat, readlink=os.readlink, getcwd=os.getcwd,
                                      getcwdb=os.getcwdb, fsdecode=os.fsdecode, sep=os.sep, stat=os.stat)
    namespace["stat"] = SimpleNamespace(S_ISLNK=stat.S_ISLNK)
    for name, value in list(namespace.items()):
        if isinstance(value, FunctionType):
            copy = FunctionType(value.__code__, namespace, name, value.__defaults__, value.__closure__)
            copy.__kwdefaults__ = dict(value.__kwdefaults__ or {})
            namespace[name] = copy
    return namespace["realpath"]


def install_guards(job_dir: str | os.PathLike, allow: list[bool] | None = None) -> None:
    """Install the audit hook (process-wide, cannot be removed).

    Files: any path argument must resolve inside ``job_dir`` (reads too: no /proc or home secrets);
    ``open`` of a bare file descriptor is refused. Processes, signals, sockets, ctypes, memfd, pidfd,
    fallocate, imports of modules not loaded yet, frame and GC introspection and code object creation
    are refused outright, and so are ``compile`` and ``exec`` unless ``allow[0]`` is true (only the
    test-only raw loader sets it: the interpreter compiles nothing). Every constant the hook reads is
    bound in its closure now, so assigning to this module's globals later changes nothing; paths are
    resolved by a private copy of ``realpath``. ``_posixsubprocess.fork_exec`` raises no audit event, so
    it is replaced by a refusal. The hook is one layer, not the boundary (native code can open files
    unseen by it): the seccomp filter, the process, its limits and its namespaces are.
    """
    root = os.path.realpath(os.fspath(job_dir))
    realpath, fsdecode, fspath, sep = _private_realpath(), os.fsdecode, os.fspath, os.sep
    denied = tuple(_DENIED_PREFIXES)
    path_events = tuple(_PATH_EVENTS.items())
    path_event = dict(path_events).get
    flag = allow if allow is not None else [False]
    pathlike, text = os.PathLike, (str, bytes)
    prefix = root + sep
    violation = GuardViolation

    def inside(path: object) -> bool:
        if isinstance(path, pathlike):
            path = fspath(path)
        if isinstance(path, text):
            try:
                resolved = realpath(fsdecode(path))
            except (OSError, ValueError):
                return False
            return resolved == root or resolved.startswith(prefix)
        return path is None  # optional arguments (dir_fd, ...) are None; fds and other objects are refused

    def hook(event: str, args: tuple) -> None:
        if event in ("compile", "exec") and flag[0]:
            return
        if event.startswith(denied):
            what = f"import of {args[0]!r}" if event == "import" and args and isinstance(args[0], str) else event
            raise violation(f"sandbox: {what} is not allowed")
        count = path_event(event)
        if count is not None and not all(inside(a) for a in args[:count]):
            raise violation(f"sandbox: {event} outside the job directory is not allowed")

    def refuse(*args, **kwargs):
        raise violation("sandbox: starting processes is not allowed")

    for module_name, attr in (("_posixsubprocess", "fork_exec"), ("subprocess", "_fork_exec")):
        module = sys.modules.get(module_name)
        if module is not None and hasattr(module, attr):
            setattr(module, attr, refuse)
    sys.addaudithook(hook)


# --- entry point ------------------------------------------------------------------------------------


def features_from_bytes(data: bytes) -> dict[str, Features]:
    """Features from a safetensors file's bytes (``features.save_features`` format; no code runs)."""
    from safetensors.torch import load as load_tensors

    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    meta = json.loads(header["__metadata__"]["scalars"])
    tensors = load_tensors(data)
    return {key: Features.from_parts({name: tensors[f"{key}.{name}"] for name in TENSOR_FIELDS}, scalars)
            for key, scalars in meta.items()}


def _read_fd(fd: int) -> bytes:
    chunks = []
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, 1 << 24):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def main(job_dir: str, features_fd: int = -1) -> int:
    """Run the job in ``job_dir``; the result frame goes to stdout. The exit code is 0 whenever it was written."""
    job = Path(job_dir)
    try:
        spec = json.loads((job / "job.json").read_text())
        source = (job / "program.py").read_text(encoding="utf-8")
        window, seeds = int(spec["window"]), [int(s) for s in spec.get("synthetic_seeds", (0, 1))]
        limits = Limits(**spec.get("limits", {}))
        features = features_from_bytes(_read_fd(features_fd)) if features_fd >= 0 else {}
        loader = _raw_loader(job, spec.get("raw_loader"))
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        _warm_up(window)
        _safetensors_bytes({"warm_up": torch.zeros(2, 3)})
        remove_native_io()
        problem = seccomp.install() if spec.get("seccomp", True) else "seccomp off by request"
    except Exception as err:  # noqa: BLE001 - the job itself is broken: not the candidate's fault
        os.write(1, SETUP_FAILED + _short(err).encode("utf-8", "replace")[:300])
        return 0
    os.environ.clear()  # nothing of the parent's environment stays in reach, even if scrubbed already
    warnings.simplefilter("ignore")  # showing a warning reads source files and imports: both refused below
    prepared = _prepare(source, limits, loader)  # parsing raises a "compile" audit event: before the hook
    allow = [False]
    if spec.get("audit_hook", True):
        install_guards(job, allow)
    os.write(1, READY)  # the parent's timeout for the candidate starts now
    result, scores = _run_candidate(prepared, window, seeds, features, loader, allow)
    result["seccomp"] = problem or "on"
    _emit(result, _safetensors_bytes(scores) if scores else b"")
    return 0


def _emit(result: dict, scores: bytes) -> None:
    data = json.dumps(result).encode()
    frame = struct.pack("<Q", len(data)) + data + struct.pack("<Q", len(scores)) + scores
    view = memoryview(frame)
    while view:
        view = view[os.write(1, view):]


def _raw_loader(job: Path, name: str | None):
    """Tests only (the hostile corpus, "process layer alone"): a trusted loader file shipped in the job
    dir that turns the source into a callable by running it as Python. Never set by kvsieve itself."""
    if not name:
        return None
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvsieve_raw_loader", job / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load


def _prepare(source: str, limits: Limits, loader) -> tuple:
    """``(program, score_fn or None, error or None)``: the source parsed as data (nothing of it runs)."""
    try:
        program = Program(source)
        program.selection_params  # noqa: B018 - validates SELECTION
        if loader is not None:
            return program, None, None
        return program, ScoreProgram(source, limits=limits, filename="program"), None
    except Exception as err:  # noqa: BLE001 - reported once the candidate's time has started
        return None, None, err


def _run_candidate(prepared, window, seeds, features, loader, allow) -> tuple[dict, dict]:
    invariants: dict[str, bool] = {}
    scores: dict[str, torch.Tensor] = {}
    program, score_fn, error = prepared
    try:
        if error is not None:
            raise error
        if loader is not None:
            allow[0] = True
            try:
                score_fn = loader(program.source)
            finally:
                allow[0] = False
        shapes = [tuple(f.attn.shape) for f in features.values()]
        invariants, reason = check_invariants(score_fn, program, window, seeds, shapes)
        if reason:
            return {"status": "invalid", "reason": reason, "invariants": invariants}, {}
        growth = ""
        if isinstance(score_fn, ScoreProgram):  # the cost model's count (the raw loader of the tests has none)
            measured = work_growth(score_fn)
            growth = str(measured)
            invariants["linear_work"] = measured.exponent <= MAX_WORK_EXPONENT
            if not invariants["linear_work"]:
                return {"status": "invalid", "reason": f"its work grows faster than the context: {growth}; at most "
                        f"n^{MAX_WORK_EXPONENT} is allowed", "invariants": invariants, "work_growth": growth}, {}
        for key, feats in features.items():
            out = score_fn(feats)
            if type(out) is not torch.Tensor or tuple(out.shape) != feats.score_shape or not out.is_floating_point():
                return {"status": "invalid", "reason": f"scores for {key!r}: expected a float tensor of shape "
                        f"{feats.score_shape}, got {_describe(out)}", "invariants": invariants}, {}
            out = out.detach().to(torch.float32).contiguous()
            if not bool(torch.isfinite(out).all()):
                return {"status": "invalid", "reason": f"scores for {key!r} are not all finite",
                        "invariants": invariants}, {}
            scores[key] = out
        return {"status": "ok", "reason": "", "invariants": invariants, "work_growth": growth}, scores
    except LimitExceeded as err:
        return {"status": "killed", "reason": _short(err), "invariants": invariants}, {}
    except (ProgramError, InterpreterError) as err:
        status = "error" if type(err).__name__ == "ProgramFailed" else "invalid"
        return {"status": status, "reason": _short(err), "invariants": invariants}, {}
    except BaseException as err:  # noqa: BLE001 - anything the candidate raises, SystemExit included
        if _out_of_memory(err):
            return {"status": "killed", "reason": f"memory limit: {_short(err)}", "invariants": invariants}, {}
        return {"status": "error", "reason": _short(err), "invariants": invariants}, {}


def _out_of_memory(err: BaseException) -> bool:
    """Python's MemoryError, or torch's CPU allocator failing under the address-space limit."""
    return isinstance(err, MemoryError) or (isinstance(err, RuntimeError) and "can't allocate memory" in str(err))


def _safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """float32 tensors in the safetensors format (u64 header size, JSON header, raw little-endian data),
    written here because ``safetensors.torch.save`` goes through ctypes, which the guards refuse."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors data is little-endian; this machine is not")
    header, chunks, offset = {}, [], 0
    for key, tensor in tensors.items():
        data = tensor.detach().to(torch.float32).contiguous().numpy().tobytes()
        header[key] = {"dtype": "F32", "shape": list(tensor.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def _warm_up(window: int) -> None:
    """Run every operation of the language once on synthetic features, so lazy imports and first-call
    initialisation inside torch happen before the guards refuse new imports."""
    f = synthetic_features(0, group=3, n=window + 5, window=window)
    operations.warm_up(f.attn)
    x = f.attn.mean(dim=2)
    for allocation in ALLOCATIONS:  # the selection's own kernels (kthvalue, cumsum, masked indexing)
        Selection(allocation=allocation).kept_indices(x, 2)
    torch.topk(x, 2, dim=-1)
    torch.broadcast_shapes((2, 1), (1, 3))
    ScoreProgram("def score(f):\n    return pool(group_mean(f.attn), 5) + 0.0 * f.key_norm\n")(f)


if __name__ == "__main__":
    code = main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else -1)
    sys.stdout.flush()
    os._exit(code)  # skip interpreter teardown: no finalisers run under the guards
