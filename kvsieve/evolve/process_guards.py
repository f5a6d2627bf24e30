"""The sandboxed worker's in-process guards: an audit hook and the removal of unaudited native file I/O.

:func:`remove_native_io` replaces torch's and numpy's file readers and writers by refusals; :func:`install_guards`
installs the audit hook that confines paths to the job directory and refuses processes, signals, sockets, new
imports and code creation. Both run in the worker (``worker.py``) after its own loading and before the candidate
is parsed. They are one layer, not the boundary: the seccomp filter (``seccomp.py``), the process, its limits and
its namespaces (``sandbox.py``) are.
"""

from __future__ import annotations

import os
import sys

__all__ = ["GuardViolation", "install_guards", "remove_native_io"]

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
