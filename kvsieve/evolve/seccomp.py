"""A seccomp filter for the sandbox worker, written as raw classic BPF and installed with ``prctl`` (ctypes).

No dependency (libseccomp is not needed): the filter is a list of ``struct sock_filter`` built here.
It is installed in the worker after torch and the features are loaded and before the candidate runs,
with ``no_new_privs`` set, and it cannot be removed. It refuses (``EPERM``) what a scorer never
needs and what the other layers cannot count or see: every socket, memfd, fallocate, pidfd,
process creation (``fork``/``vfork``/``execve``, ``clone`` without ``CLONE_THREAD``), signals to any
process but the worker itself, ptrace and cross-process memory, namespaces and mounts, System V and
POSIX IPC, io_uring, bpf, userfaultfd, perf, keyrings, modules and changing credentials. ``clone3``
answers ``ENOSYS`` so that the C library falls back to ``clone`` for threads. A foreign architecture
(or the x32 ABI) kills the process. x86-64 only: elsewhere :func:`install` reports that no filter
went in, and the sandbox reports its isolation level accordingly.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct

__all__ = ["install", "supported", "DENIED"]

# x86-64 syscall numbers (arch/x86/entry/syscalls/syscall_64.tbl)
DENIED = {
    "socket": 41, "socketpair": 53, "fork": 57, "vfork": 58, "execve": 59, "execveat": 322,
    "tkill": 200, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
    "memfd_create": 319, "memfd_secret": 447, "fallocate": 285, "pidfd_open": 434, "pidfd_send_signal": 424,
    "pidfd_getfd": 438, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "unshare": 272,
    "setns": 308, "move_mount": 429, "open_tree": 428, "fsopen": 430, "fsmount": 432, "bpf": 321,
    "perf_event_open": 298, "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "keyctl": 250, "add_key": 248, "request_key": 249, "mknod": 133, "mknodat": 259,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "init_module": 175, "finit_module": 313,
    "delete_module": 176, "kexec_load": 246, "kexec_file_load": 320, "reboot": 169, "swapon": 167,
    "swapoff": 168, "acct": 163, "settimeofday": 164, "clock_settime": 227, "setuid": 105, "setgid": 106,
    "setreuid": 113, "setregid": 114, "setresuid": 117, "setresgid": 119, "setgroups": 116, "setsid": 112,
    "setpgid": 109, "shmget": 29, "shmat": 30, "shmctl": 31, "semget": 64, "msgget": 68, "mq_open": 240,
    "process_madvise": 440, "kcmp": 312, "quotactl": 179, "vhangup": 153,
}
_CLONE, _CLONE3, _KILL, _TGKILL = 56, 435, 62, 234
_CLONE_THREAD = 0x00010000
_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_BIT = 0x40000000

_LD_ABS_W, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_ALLOW, _RET_KILL_PROCESS, _RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_EPERM, _ENOSYS = 1, 38
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
# offsets in struct seccomp_data: nr, arch, instruction pointer, args[6] (u64, little-endian)
_NR, _ARCH, _ARG0_LO, _ARG0_HI = 0, 4, 16, 20


def supported() -> bool:
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


def _program(pid: int) -> list[tuple[int, int, int, int]]:
    """The filter: (code, jt, jf, k) with jumps resolved from labels."""
    code: list = []

    def ins(op: int, k: int, jt: str | int = 0, jf: str | int = 0) -> None:
        code.append([op, jt, jf, k])

    ins(_LD_ABS_W, _ARCH)
    ins(_JEQ, _AUDIT_ARCH_X86_64, 1, 0)
    ins(_RET, _RET_KILL_PROCESS)
    ins(_LD_ABS_W, _NR)
    ins(_JGE, _X32_BIT, "deny", 0)
    for number in sorted(set(DENIED.values())):
        ins(_JEQ, number, "deny", 0)
    ins(_JEQ, _CLONE3, "enosys", 0)
    ins(_JEQ, _CLONE, "clone", 0)
    ins(_JEQ, _KILL, "self", 0)
    ins(_JEQ, _TGKILL, "self", 0)
    ins(_RET, _RET_ALLOW)
    labels = {"clone": len(code)}  # threads only: clone(flags) with CLONE_THREAD set
    ins(_LD_ABS_W, _ARG0_LO)
    ins(_JSET, _CLONE_THREAD, "allow", "deny")
    labels["self"] = len(code)  # kill(pid, ...) / tgkill(tgid, ...) of this process only
    ins(_LD_ABS_W, _ARG0_LO)
    ins(_JEQ, pid, 0, "deny")
    ins(_LD_ABS_W, _ARG0_HI)
    ins(_JEQ, 0, "allow", "deny")
    labels["allow"] = len(code)  # the returns come last: classic BPF jumps forward only
    ins(_RET, _RET_ALLOW)
    labels["deny"] = len(code)
    ins(_RET, _RET_ERRNO | _EPERM)
    labels["enosys"] = len(code)
    ins(_RET, _RET_ERRNO | _ENOSYS)
    out = []
    for i, (op, jt, jf, k) in enumerate(code):
        jt = labels[jt] - i - 1 if isinstance(jt, str) else jt
        jf = labels[jf] - i - 1 if isinstance(jf, str) else jf
        if not (0 <= jt < 256 and 0 <= jf < 256):
            raise AssertionError(f"seccomp jump out of range at instruction {i}")
        out.append((op, jt, jf, k))
    return out


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install() -> str:
    """Install the filter in this process (irreversible); "" on success, else why not."""
    if not supported():
        return f"seccomp filter not available on {platform.system()} {platform.machine()}"
    program = _program(os.getpid())
    blob = b"".join(struct.pack("<HBBI", *ins) for ins in program)
    buffer = ctypes.create_string_buffer(blob, len(blob))
    prog = _SockFprog(len(program), ctypes.cast(buffer, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return f"prctl(PR_SET_NO_NEW_PRIVS) failed: {os.strerror(ctypes.get_errno())}"
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0) != 0:
        return f"prctl(PR_SET_SECCOMP) failed: {os.strerror(ctypes.get_errno())}"
    return ""
