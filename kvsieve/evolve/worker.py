"""The sandboxed side: runs one candidate in its own process (``python -m kvsieve.evolve.worker JOB_DIR``).

``sandbox.py`` starts it in a fresh job directory holding ``job.json`` (``window``, ``features`` path or
null, ``synthetic_seeds``) and ``program.py``. Order matters: torch, the kvsieve modules and the
features file are loaded first, then the guards go in (an audit hook that refuses files outside the
job directory, sockets, processes, signals, ctypes, new imports and frame/GC introspection), and
only then is the candidate compiled and run. It runs the stage-1 invariants on synthetic features,
scores the features file if given (``scores.safetensors``) and always writes ``result.json``.
The parent never trusts either file: it validates both (``sandbox.py``).
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

from kvsieve.evolve.features import Features, compile_score, load_features, synthetic_features
from kvsieve.evolve.program import Program, ProgramError

__all__ = ["check_invariants", "install_guards", "invariant_cases", "main", "INVARIANTS"]

INVARIANTS = ("tensor", "float", "shape", "finite", "inputs_unchanged", "deterministic", "budget")
READY = b"ready\n"
MAX_REASON = 300


def invariant_cases(window: int, seeds: Iterable[int]) -> list[dict]:
    """Synthetic feature shapes for stage 1: one and three query heads, a context just above the window
    and a longer one (so both ends of the budget range and the chunk grid are exercised)."""
    cases = []
    for seed in seeds:
        cases.append(dict(seed=int(seed), batch=1, kv_heads=2, group=1, n=window + 5, window=window, layer=0.0))
        cases.append(dict(seed=int(seed), batch=2, kv_heads=2, group=3, n=4 * window + 37, window=window, layer=0.6))
    return cases


def check_invariants(score_fn: Callable[[Features], object], program: Program, window: int,
                     seeds: Iterable[int] = (0, 1)) -> tuple[dict[str, bool], str]:
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

    for case in invariant_cases(window, seeds):
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
    """Each head keeps at most the budget, distinct in-range entries, at a tight and a loose budget."""
    protected = int(selection.protected_mask(n, n).sum())
    for kept in sorted({min(n, protected + 1), min(n, protected + (n - protected) // 2)}):
        indices, _ = selection.kept_indices(scores.detach().float(), kept)
        if indices.shape[-1] > kept or (indices.numel() and (indices.min() < 0 or indices.max() >= n)):
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
                    "os.chdir", "ctypes.", "pty.", "signal.", "resource.", "mmap.", "sys._getframe",
                    "sys._current_frames", "sys.setprofile", "sys.settrace", "gc.get_", "object.__getattr__",
                    "object.__setattr__", "object.__delattr__", "function.__new__", "code.__new__", "cpython.",
                    "marshal.", "pickle.", "import", "urllib.", "http.", "ftplib.", "smtplib.", "webbrowser.",
                    "shutil.", "winreg.", "syslog.", "sqlite3.", "fcntl.", "sys.addaudithook", "builtins.input",
                    "tempfile.")
_PATH_EVENTS = {"open": 1, "os.remove": 1, "os.rename": 2, "os.mkdir": 1, "os.rmdir": 1, "os.chmod": 1,
                "os.chown": 1, "os.symlink": 2, "os.link": 2, "os.truncate": 1, "os.utime": 1, "os.listdir": 1,
                "os.scandir": 1, "os.mkfifo": 1, "os.mknod": 1, "os.chflags": 1, "os.lchflags": 1,
                "os.setxattr": 1, "os.removexattr": 1, "os.listxattr": 1, "os.getxattr": 1, "glob.glob": 1}


class GuardViolation(PermissionError):
    """Raised by the audit hook; the message names the refused event."""


def install_guards(job_dir: str | os.PathLike, allow_compile: list[bool]) -> None:
    """Install the audit hook (process-wide, cannot be removed).

    Files: any path argument must resolve inside ``job_dir`` (reads too: no /proc or home secrets);
    ``open`` of a bare file descriptor is refused. Processes, signals, sockets, ctypes, imports of
    modules not loaded yet, frame and GC introspection and code object creation are refused outright.
    ``compile``/``exec`` are allowed only while ``allow_compile[0]`` is true (compiling the candidate).
    ``_posixsubprocess.fork_exec`` raises no audit event, so it is replaced by a refusal. Irreversible
    and process-wide: call it only in the worker. The hook is one layer, not the boundary (torch's C++
    can open files and sockets unseen by it): the process, its limits and its namespaces are.
    """
    root = os.path.realpath(os.fspath(job_dir))
    realpath, fsdecode, sep = os.path.realpath, os.fsdecode, os.sep

    def inside(path: object) -> bool:
        if isinstance(path, os.PathLike):
            path = os.fspath(path)
        if isinstance(path, (str, bytes)):
            try:
                resolved = realpath(fsdecode(path))
            except (OSError, ValueError):
                return False
            return resolved == root or resolved.startswith(root + sep)
        return path is None  # optional arguments (dir_fd, ...) are None; fds and other objects are refused

    def hook(event: str, args: tuple) -> None:
        if event in ("compile", "exec"):
            if allow_compile[0]:
                return
            raise GuardViolation(f"sandbox: {event} is not allowed")
        if event.startswith(_DENIED_PREFIXES):
            what = f"import of {args[0]!r}" if event == "import" and args and isinstance(args[0], str) else event
            raise GuardViolation(f"sandbox: {what} is not allowed")
        count = _PATH_EVENTS.get(event)
        if count is not None and not all(inside(a) for a in args[:count]):
            raise GuardViolation(f"sandbox: {event} outside the job directory is not allowed")

    def refuse(*args, **kwargs):
        raise GuardViolation("sandbox: starting processes is not allowed")

    for module_name, attr in (("_posixsubprocess", "fork_exec"), ("subprocess", "_fork_exec")):
        module = sys.modules.get(module_name)
        if module is not None and hasattr(module, attr):
            setattr(module, attr, refuse)
    sys.addaudithook(hook)


# --- entry point ------------------------------------------------------------------------------------


def main(job_dir: str) -> int:
    """Run the job in ``job_dir``; the exit code is 0 whenever ``result.json`` was written."""
    job = Path(job_dir).resolve()
    result: dict = {"status": "error", "reason": "", "invariants": {}}
    try:
        spec = json.loads((job / "job.json").read_text())
        source = (job / "program.py").read_text(encoding="utf-8")
        window, seeds = int(spec["window"]), [int(s) for s in spec.get("synthetic_seeds", (0, 1))]
        features = load_features(spec["features"]) if spec.get("features") else {}
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        _warm_up(window)
        result_path = job / "result.json"
        scores_path = job / "scores.safetensors"
        _safetensors_bytes({"warm_up": torch.zeros(2, 3)})
    except Exception as err:  # noqa: BLE001 - the job itself is broken: not the candidate's fault
        result["reason"] = f"sandbox worker setup failed: {_short(err)}"
        (job / "result.json").write_text(json.dumps(result))
        return 0
    os.environ.clear()  # nothing of the parent's environment stays in reach, even if scrubbed already
    warnings.simplefilter("ignore")  # showing a warning reads source files and imports: both refused below
    allow_compile = [True]
    install_guards(job, allow_compile)
    os.write(1, READY)  # the parent's timeout for the candidate starts now
    result = _run_candidate(source, window, seeds, features, scores_path, allow_compile)
    with open(result_path, "w") as handle:
        handle.write(json.dumps(result))
    return 0


def _run_candidate(source, window, seeds, features, scores_path, allow_compile) -> dict:
    invariants: dict[str, bool] = {}
    try:
        try:
            program = Program(source)
            program.selection_params  # noqa: B018 - validates SELECTION
            score_fn = compile_score(source)
        finally:
            allow_compile[0] = False
        invariants, reason = check_invariants(score_fn, program, window, seeds)
        if reason:
            return {"status": "invalid", "reason": reason, "invariants": invariants}
        scores = {}
        for key, feats in features.items():
            out = score_fn(feats)
            if type(out) is not torch.Tensor or tuple(out.shape) != feats.score_shape or not out.is_floating_point():
                return {"status": "invalid", "reason": f"scores for {key!r}: expected a float tensor of shape "
                        f"{feats.score_shape}, got {_describe(out)}", "invariants": invariants}
            out = out.detach().to(torch.float32).contiguous()
            if not bool(torch.isfinite(out).all()):
                return {"status": "invalid", "reason": f"scores for {key!r} are not all finite",
                        "invariants": invariants}
            scores[key] = out
        if features:
            with open(scores_path, "wb") as handle:
                handle.write(_safetensors_bytes(scores))
        return {"status": "ok", "reason": "", "invariants": invariants}
    except ProgramError as err:
        return {"status": "invalid", "reason": _short(err), "invariants": invariants}
    except BaseException as err:  # noqa: BLE001 - anything the candidate raises, SystemExit included
        if _out_of_memory(err):
            return {"status": "killed", "reason": f"memory limit: {_short(err)}", "invariants": invariants}
        return {"status": "error", "reason": _short(err), "invariants": invariants}


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
    """Run every allowed helper and torch function once on synthetic features, so lazy imports and
    first-call initialisation inside torch happen before the guards refuse new imports."""
    from kvsieve.evolve import features as feats

    f = synthetic_features(0, group=3, n=window + 5, window=window)
    x = feats.HELPERS["group_mean"](f.attn)
    for helper in feats.HELPERS.values():
        try:
            helper(f.attn, 5) if helper.__code__.co_argcount == 2 else helper(f.attn)
        except Exception:  # noqa: BLE001, S110 - a warm-up only
            pass
    for name in feats.TORCH_FUNCTIONS:
        fn = getattr(torch, name)
        for args in ((x,), (x, -1), (x, x), (x > 0, x, x), ([x, x],), (x, 1, -1)):
            try:
                fn(*args)
            except Exception:  # noqa: BLE001, S110
                continue
    for name in feats.TENSOR_METHODS:
        attr = getattr(x, name, None)
        if callable(attr):
            for args in ((), (-1,), (2,), (x,), (x.shape,)):
                try:
                    attr(*args)
                except Exception:  # noqa: BLE001, S110
                    continue
    torch.nan_to_num(x.double(), nan=float("-inf")).argsort(dim=-1, stable=True)
    torch.topk(x, 2, dim=-1)


if __name__ == "__main__":
    code = main(sys.argv[1])
    sys.stdout.flush()
    os._exit(code)  # skip interpreter teardown: no finalisers run under the guards
