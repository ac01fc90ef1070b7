"""The sandbox's own uids under root, and the processes of a uid (``engines.rewards.sandbox``).

As root each ``run_python`` runs its code as a uid of its own from ``[2**30, 2**30+2**20)`` (never a real
user's), held for the run by this process (a set) and against other processes (a byte-range lock on
``/run/rollflow-sandbox-uids.lock``, in the temp dir when ``/run`` is not writable): then
``RLIMIT_NPROC`` counts that run's processes only, and ``kill_uid`` ends every process left after it.
"""

from __future__ import annotations

import fcntl
import os
import random
import signal
import tempfile
import threading
import time

_UID_BASE, _UID_COUNT = 1 << 30, 1 << 20  # sandbox uids under root: one per run, never a real user's
_LOCK_PATH = "/run/rollflow-sandbox-uids.lock"  # byte uid - _UID_BASE locked while a run holds that uid


class SandboxError(RuntimeError):
    """The sandbox could not be set up (an environment problem, not the code's fault); also
    ``engines.rewards.sandbox.SandboxError``."""


_uids_lock = threading.Lock()
_uids_in_use: set[int] = set()
_lock_fd: list[int] = []  # kept open for the process's life: closing any fd of the file drops POSIX locks


def claim_uid() -> int:
    """A uid no other run (thread or process) holds, until ``release_uid``."""
    if not _uid_range_mapped():
        raise SandboxError(f"uids {_UID_BASE}..{_UID_BASE + _UID_COUNT - 1} are not mapped in this user "
                           "namespace (/proc/self/uid_map); the sandbox runs code as one of them")
    with _uids_lock:
        if not _lock_fd:
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                path, fd = _LOCK_PATH, os.open(_LOCK_PATH, flags, 0o600)
            except OSError:  # no writable /run
                path = os.path.join(tempfile.gettempdir(), os.path.basename(_LOCK_PATH))
                fd = os.open(path, flags, 0o600)
            if os.fstat(fd).st_uid != 0:
                os.close(fd)
                raise SandboxError(f"the sandbox uid lock file {path} is not owned by root")
            _lock_fd.append(fd)
        for _ in range(1000):
            uid = _UID_BASE + random.randrange(_UID_COUNT)
            if uid in _uids_in_use:
                continue
            try:
                fcntl.lockf(_lock_fd[0], fcntl.LOCK_EX | fcntl.LOCK_NB, 1, uid - _UID_BASE)
            except OSError:  # another process runs a sandbox as this uid
                continue
            _uids_in_use.add(uid)
            return uid
    raise SandboxError("no free sandbox uid after 1000 draws")


def release_uid(uid: int) -> None:
    with _uids_lock:
        fcntl.lockf(_lock_fd[0], fcntl.LOCK_UN, 1, uid - _UID_BASE)
        _uids_in_use.discard(uid)


def _uid_range_mapped() -> bool:
    with open("/proc/self/uid_map") as f:
        ranges = [[int(x) for x in line.split()] for line in f]
    return any(inner <= _UID_BASE and _UID_BASE + _UID_COUNT <= inner + count for inner, _, count in ranges)


def _status_of(pid: int | str) -> tuple[set[int], str, int] | None:
    """(uids, state, threads) of a process from /proc/<pid>/status; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None
    return {int(x) for x in fields["Uid"].split()}, fields["State"].split()[0], int(fields["Threads"])


def _live(uid: int) -> list[tuple[int, int]]:
    """(pid, threads) of every live (non-zombie) process with ``uid`` among its uids."""
    infos = [(int(name), _status_of(name)) for name in os.listdir("/proc") if name.isdigit()]
    return [(pid, info[2]) for pid, info in infos if info and uid in info[0] and info[1] != "Z"]


def count_tasks(uid: int) -> int:
    """Processes + threads running as ``uid`` now: what RLIMIT_NPROC counts."""
    return sum(threads for _, threads in _live(uid))


def kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` until none is left; a pidfd pins each, so a reused pid is safe."""
    for _ in range(200):
        pids = [pid for pid, _ in _live(uid)]
        if not pids:
            return
        for pid in pids:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:  # already gone
                continue
            try:
                info = _status_of(pid)  # read after pinning: still the same process if it is still there
                if info and uid in info[0]:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(pidfd)
        time.sleep(0.001)
    raise SandboxError(f"processes of sandbox uid {uid} survive SIGKILL: {_live(uid)}")
