"""Where a stored row came from: the machine, the arithmetic and the code that computed it.

Every row the results store writes carries a provenance record (``ResultsStore`` stamps rows that come
without one with :func:`current`): the device (the CPU's model name and its bf16 features, or the GPU's
name), the cores and torch threads, the dtype, the kvsieve, torch and transformers versions and the code
revision (``git rev-parse HEAD`` of the checkout kvsieve runs from, with a dirty flag for edits outside
``results/``; ``None`` where git or the checkout is absent: never an error). Rows written before this record
existed have none: :data:`UNKNOWN`.

Comparisons pair rows. Rows from two machines differ in their kernels (bf16 AMX vs AVX2 float32 flip
near-tie tokens), so :func:`check_one_machine` refuses to put them in one table unless asked, and
:func:`describe` says what a table's rows came from. Standard library only: this module is read by light
commands (``kvsieve report``); torch's thread count and version are read only where torch is loaded.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["MIXED_FLAG", "UNKNOWN", "check_one_machine", "current", "describe", "machine_of", "machines",
           "revision"]

UNKNOWN = "unknown (written before rows recorded provenance)"
MIXED_FLAG = "--mixed-machines"  # the CLI flag that allows pairing rows of several machines
_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # the CPU features that decide kvsieve's dtype and bf16 kernels
_REPO = Path(__file__).resolve().parents[2]


def _cpuinfo() -> tuple[str, list[str]]:
    """The CPU's model name and its bf16 features, from /proc/cpuinfo (Linux), else ``platform``."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    name, flags = "", set()
    for line in text.splitlines():
        field, _, value = line.partition(":")
        field = field.strip()
        if field == "model name" and not name:
            name = value.strip()
        elif field == "flags" and not flags:
            flags = set(value.split())
    name = name or platform.processor() or platform.machine() or "unknown CPU"
    return name, [f for f in _BF16_FLAGS if f in flags]


@functools.lru_cache(maxsize=1)
def revision() -> dict[str, Any]:
    """``{"commit": sha or None, "dirty": bool or None}`` of the git checkout kvsieve runs from (cached: one
    process computes with one revision). Installed from a wheel, or without git: both ``None``."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(_REPO), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return {"commit": None, "dirty": None}
    # the committed results (results/: stores, reports) are data, written by the runs themselves: a store a run
    # fills is not an edit of the code that fills it
    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results")
    return {"commit": commit.strip(), "dirty": None if status is None else bool(status.strip())}


def _device(device: str) -> str:
    """The device's name as rows record it: the GPU's name for ``cuda``, else the CPU's with its bf16 features."""
    torch = sys.modules.get("torch")
    if device.startswith("cuda") and torch is not None and torch.cuda.is_available():
        return f"GPU {torch.cuda.get_device_name(torch.device(device))}"
    name, flags = _cpuinfo()
    return f"{name} ({', '.join(flags) if flags else 'no bf16 instructions'})"


def current(dtype: str | None = None, device: str | None = None) -> dict[str, Any]:
    """This process's provenance for a row computed on ``device`` (default: ``KVSIEVE_DEVICE``, where
    ``kvsieve --device`` puts it, else the CPU) in ``dtype``."""
    device = device or os.environ.get("KVSIEVE_DEVICE") or "cpu"
    torch = sys.modules.get("torch")  # loaded wherever rows are computed; a reader never needs it
    threads = torch.get_num_threads() if torch is not None else None
    if threads is None and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        threads = int(os.environ["OMP_NUM_THREADS"])
    transformers = sys.modules.get("transformers")
    kvsieve = sys.modules.get("kvsieve")
    return {"machine": _device(device), "cores": os.cpu_count(), "threads": threads, "dtype": dtype,
            "kvsieve": getattr(kvsieve, "__version__", None),
            "torch": getattr(torch, "__version__", None) if torch is not None else None,
            "transformers": getattr(transformers, "__version__", None) if transformers is not None else None,
            "python": platform.python_version(), **revision()}


def machine_of(provenance: dict[str, Any] | None) -> str:
    """The machine a row's provenance names; :data:`UNKNOWN` for rows without one."""
    return (provenance or {}).get("machine") or UNKNOWN


def machines(provenances: Iterable[dict[str, Any] | None]) -> Counter:
    """How many rows each machine computed."""
    return Counter(machine_of(p) for p in provenances)


def check_one_machine(provenances: Iterable[dict[str, Any] | None], what: str, allow_mixed: bool = False) -> Counter:
    """The rows' machines; ``ValueError`` naming them when there are several and ``allow_mixed`` is false.

    Rows without provenance count as one more machine (:data:`UNKNOWN`): they may come from any.
    """
    counts = machines(provenances)
    if len(counts) > 1 and not allow_mixed:
        held = "; ".join(f"{m}: {n} rows" for m, n in counts.most_common())
        raise ValueError(f"{what} pairs rows of {len(counts)} machines ({held}); their kernels differ, so a "
                         f"difference may be the machine's. Pass {MIXED_FLAG} to pair them anyway, or filter the "
                         "rows to one machine")
    return counts


def _short(commit: str | None, dirty: bool | None) -> str:
    if not commit:
        return "no git revision"
    return commit[:10] + ("+dirty" if dirty else "")


def describe(provenances: Iterable[dict[str, Any] | None]) -> str:
    """One line: the machines, dtypes, threads and revisions of a table's rows, with row counts where several."""
    items = list(provenances)

    def counted(values: Iterable[str]) -> str:
        counts = Counter(values)
        if len(counts) == 1:
            return next(iter(counts))
        return ", ".join(f"{v} ({n} rows)" for v, n in counts.most_common())

    known = [p for p in items if p]
    parts = [f"machine {counted(machine_of(p) for p in items)}"]
    if known:
        parts += [f"dtype {counted(str(p.get('dtype')) for p in known)}",
                  f"threads {counted(str(p.get('threads')) for p in known)}",
                  f"kvsieve {counted(str(p.get('kvsieve')) for p in known)}",
                  f"revision {counted(_short(p.get('commit'), p.get('dirty')) for p in known)}"]
    return "; ".join(parts)
