"""The sandboxed worker: interprets one candidate in its own process (started by ``sandbox.py``).

The job directory holds ``job.json`` (``window``, ``synthetic_seeds``, the interpreter's limits) and
``program.py``; the features come as an open file descriptor (so the worker needs no path to them).
Order matters: torch, the kvsieve modules and the features are loaded first; then torch's and
numpy's unaudited native file I/O is removed and the audit hook goes in (``process_guards.py``), with the
seccomp filter (``seccomp.py``), and only then is the candidate parsed and interpreted (``interpreter.py``: no
candidate code runs as Python). It runs the stage-1 invariants (``stage1_invariants.py``) on synthetic features and
on the real features' shapes, scores the features, and writes one frame to stdout after the ready line:
``u64 length, JSON result, u64 length, safetensors scores``. It writes no file: the parent reads
the pipe with a size cap and a deadline and validates everything (``sandbox.py``).
"""

from __future__ import annotations

import json
import os
import struct
import sys
import warnings
from pathlib import Path

import torch

from kvsieve.evolve import seccomp
from kvsieve.evolve.process_guards import install_guards, remove_native_io
from kvsieve.evolve.stage1_invariants import check_invariants, describe_output
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

__all__ = ["features_from_bytes", "main"]

READY = b"ready\n"
SETUP_FAILED = b"setup-failed\n"  # before the ready line: the sandbox's failure, never the candidate's
MAX_REASON = 300


def _short(err: BaseException) -> str:
    """``Type: message`` cut short; no traceback, so no paths of this machine leak into the reason."""
    try:
        text = str(err)
    except Exception:  # noqa: BLE001 - a hostile __str__
        text = ""
    text = " ".join(text.split())
    return f"{type(err).__name__}: {text}"[:MAX_REASON] if text else type(err).__name__


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
        if loader is not None:
            program.selection_params  # noqa: B018 - validates SELECTION
            return program, None, None
        score_fn = ScoreProgram(source, limits=limits, filename="program")  # first: its refusals name the line
        program.selection_params  # noqa: B018 - validates SELECTION
        return program, score_fn, None
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
                        f"{feats.score_shape}, got {describe_output(out)}", "invariants": invariants}, {}
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
