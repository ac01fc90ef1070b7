"""``run_python``: run untrusted Python (a model's completion) in a bounded, isolated subprocess.

One call = one fresh ``sys.executable -s -S -P -B -c <bootstrap>`` in a new session, stdio on pipes, and an
environment built from scratch: ``PATH``, ``LANG``, ``HOME`` = ``TMPDIR`` = the run's temp dir,
``PYTHONHASHSEED=0``, ``PYTHONUTF8=1``, ``MALLOC_ARENA_MAX=2`` (nothing inherited, so no secret in
``os.environ`` reaches the code). ``-s -P`` with that environment is what ``-I`` gives; ``-I`` itself
(it implies ``-E``) would also drop ``PYTHONHASHSEED=0``, and set order would change from run to run.
``-S``: no site-packages, the standard library only. The bootstrap reads the solution from the temp dir,
confines the process, and runs it as ``__main__``. The layers, in the order they are applied:

* **Temp dir**: a fresh ``mkdtemp`` per run is the cwd, ``HOME`` and ``TMPDIR``; deleted afterwards
  with whatever the code wrote there.
* **Namespaces** (root with ``CAP_SYS_ADMIN``, or an unprivileged user namespace, see ``isolation``):
  ``unshare(CLONE_NEWNET)``, a network with only a downed
  loopback; ``unshare(CLONE_NEWNS)``, a private mount table in which every mount is read-only
  (``mount_setattr(AT_RECURSIVE, MOUNT_ATTR_RDONLY)``) and the temp dir is a fresh tmpfs of
  ``max_file_bytes`` in all, the one writable place. An interpreter under a directory other users cannot
  enter (``/root/.pyenv``, ``/root`` being 0700) is exposed by covering that directory with an empty tmpfs
  and bind-mounting the interpreter's prefix back: the child imports the standard library and sees
  nothing else there. Root without the capability skips them (the audit hook still blocks sockets and
  writes), and an interpreter the sandbox uid cannot read is a ``SandboxError``. Not root, the child
  first enters a user namespace of its own (``CLONE_NEWUSER``, our uid and gid mapped to themselves)
  that owns the new network and mount namespaces, and drops the capabilities it had there (``capset``,
  ``PR_SET_NO_NEW_PRIVS``) once they are set up; where the kernel refuses user namespaces, no namespaces.
* **Resource limits**: ``RLIMIT_CPU`` = ``ceil(cpu_s)`` (SIGXCPU, SIGKILL one second later),
  ``RLIMIT_AS`` = ``memory_mb`` (big allocations raise ``MemoryError``; address space, not resident
  memory: a thread reserves an 8 MiB stack, so 256 MB allows about twenty), ``RLIMIT_FSIZE`` =
  ``max_file_bytes`` per file (``EFBIG``), ``RLIMIT_NOFILE`` = 64, ``RLIMIT_CORE`` = 0, ``RLIMIT_NPROC``.
* **Own uid** (root): root ignores ``RLIMIT_NPROC``, so the child drops to a uid of its own
  (``setgroups([])``, ``setresgid``, ``setresuid``, ``PR_SET_NO_NEW_PRIVS``) from ``[2**30, 2**30+2**20)``,
  held for the run by this process (a set) and against other processes (a byte-range lock). Then
  ``RLIMIT_NPROC = max_processes`` counts this run's processes and threads only, and every process of
  the uid left after the run is SIGKILLed (``pidfd_send_signal``) without touching a concurrent run.
  Not root: our uid, ``RLIMIT_NPROC`` = (tasks the uid runs now) + ``max_processes``.
* **Audit hook** (always; with the resource limits the only layer at isolation ``none``): a blocked event writes ``sandbox: blocked
  <event>`` to stderr and ends the process with ``VIOLATION_EXIT`` at once, so no ``except`` swallows
  it. Blocked (the lists are in ``_hook``): sockets other than ``AF_UNIX``, connect/bind/send/DNS;
  writes (``open`` with a write flag, ``os.remove``/``rename``/``mkdir``/``chmod``/...) outside the temp
  dir (``/dev/null`` and a piped ``/dev/stdout``/``/dev/stderr`` allowed), relative paths with ``..``,
  opening a directory outside it and any ``dir_fd`` (they would get around the path check), links;
  ``os.system``/``exec``/``fork``/``posix_spawn``, ``subprocess.Popen``, signals to other processes;
  ``ctypes``; tracers and ``gc`` referrer walks (they could jump over or reach the hook),
  subinterpreters (no hooks there); importing C modules with unaudited process, file or socket access
  (``_posixsubprocess``, ``_sqlite3``, ``_multiprocessing``...). The hook uses only its default
  arguments and methods of exact ``str``/``bytes``/``int``, so patching ``os.path`` or passing a
  ``str`` subclass cannot steer it. Event names and arguments checked on CPython 3.11.
* **Wall clock and output**: stdout and stderr are read with a bounded reader; past
  ``max_output_bytes`` on either, or past ``wall_s``, the process group is SIGKILLed (``os.killpg``).

Statuses: ``ok`` (exit 0); ``error`` (another exit: an exception, a syntax error); ``timeout``
(``wall_s``, or the CPU limit's SIGXCPU / SIGKILL); ``memory`` (an uncaught ``MemoryError``);
``output_limit`` (stdout or stderr past ``max_output_bytes``, an uncaught ``EFBIG``/``ENOSPC``);
``violation`` (the audit hook).

Not covered: reads (the code reads what its uid may; only the interpreter's unreadable parent is
hidden); ``os.mkfifo``/``os.mknod`` are unaudited, so without the read-only mounts an empty FIFO can be
left in a world-writable directory; no PID namespace (``/proc`` lists the host's processes). CPython
calls audit hooks no sandbox: the kernel layers are the boundary, and they need root or unprivileged
user namespaces (``isolation()`` says which this process gets; ``run_python`` logs a warning once when
it gets neither, and ``configs.schema`` refuses a ``code`` reward there unless
``reward.allow_unsandboxed_code``). A call costs
tens of milliseconds even for ``print(1)`` (interpreter start, namespaces, uid sweep).

>>> run_python("print(sum(range(10)))").stdout
'45\\n'
>>> run_python("import socket; socket.create_connection(('127.0.0.1', 80))").status
'violation'
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import pathlib
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

from engines.rewards import sandbox_uids as uids
from engines.rewards.sandbox_uids import SandboxError

VIOLATION_EXIT = 113  # the audit hook blocked an action
MEMORY_EXIT = 114  # an uncaught MemoryError
DISK_EXIT = 115  # an uncaught EFBIG / ENOSPC: a file or the temp dir is full
SETUP_EXIT = 116  # the bootstrap could not confine the process: run_python raises SandboxError

_MAX_OPEN_FILES = 64  # RLIMIT_NOFILE
_ENV_PATH = "/usr/local/bin:/usr/bin:/bin"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SandboxResult:
    """What one ``run_python`` call did.

    ``status``: ``ok`` | ``error`` | ``timeout`` | ``memory`` | ``output_limit`` | ``violation`` (see the
    module docstring); ``returncode``: the exit code, negative for a signal (``-9`` when we killed it);
    ``stdout`` / ``stderr``: decoded (UTF-8, invalid bytes replaced), at most ``max_output_bytes`` each;
    ``wall_s``: seconds from start to exit.
    """

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float


def run_python(
    code: str,
    *,
    stdin: str = "",
    wall_s: float = 5.0,
    cpu_s: float = 2.0,
    memory_mb: int = 256,
    max_output_bytes: int = 64_000,
    max_file_bytes: int = 1_000_000,
    max_processes: int = 16,
) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a confined interpreter, feeding it ``stdin``; see the module doc.

    ``wall_s``: wall-clock limit (the process group is killed); ``cpu_s``: CPU-time limit (rounded up to
    whole seconds); ``memory_mb``: address-space limit; ``max_output_bytes``: kept per stream, more is
    ``output_limit``; ``max_file_bytes``: the largest file it may write (and, with the private mount, all
    its files together); ``max_processes``: processes + threads it may run at once, itself included.
    """
    if wall_s <= 0 or cpu_s <= 0 or memory_mb <= 0 or max_output_bytes <= 0 or max_file_bytes <= 0:
        raise ValueError("run_python limits must be positive: wall_s, cpu_s, memory_mb, max_output_bytes, "
                         "max_file_bytes")
    if max_processes < 1:
        raise ValueError(f"max_processes={max_processes}: the process itself needs 1")
    level = isolation().level
    if level == "none":
        _warn_no_isolation()
    return _run_confined(code, level, stdin=stdin, wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb,
                         max_output_bytes=max_output_bytes, max_file_bytes=max_file_bytes, max_processes=max_processes)


def _run_confined(code: str, level: str, *, stdin: str, wall_s: float, cpu_s: float, memory_mb: int,
                  max_output_bytes: int, max_file_bytes: int, max_processes: int) -> SandboxResult:
    """``run_python`` with the kernel layers of ``level`` (``isolation``)."""
    root = os.path.realpath(tempfile.mkdtemp(prefix="rollflow-sandbox-"))
    uid = None
    try:
        if level == "root":
            reveal = _hidden_prefix()
            if reveal and (root + "/").startswith(reveal[0] + "/"):
                raise SandboxError(f"the sandbox temp dir {root} is inside {reveal[0]}, which the sandbox hides; "
                                   "point TMPDIR elsewhere")
            uid = uids.claim_uid()
            os.chown(root, uid, uid)
            nproc = max_processes
        else:
            reveal = None
            nproc = uids.count_tasks(os.getuid()) + max_processes
        solution, token = ".solution.py", secrets.token_hex(16)
        fd = os.open(os.path.join(root, solution), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with open(fd, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(token + "\n" + code)  # the token proves a setup failure is the bootstrap's, not the code's
        cfg = {"root": root, "solution": solution, "uid": uid, "userns": level == "userns", "reveal": reveal,
               "cpu": math.ceil(cpu_s), "mem": memory_mb << 20, "fsize": max_file_bytes, "nofile": _MAX_OPEN_FILES,
               "nproc": nproc,
               "codes": [VIOLATION_EXIT, MEMORY_EXIT, DISK_EXIT, SETUP_EXIT]}
        env = {"PATH": _ENV_PATH, "LANG": "C.UTF-8", "HOME": root, "TMPDIR": root, "PYTHONHASHSEED": "0",
               "PYTHONUTF8": "1", "MALLOC_ARENA_MAX": "2"}  # each glibc arena reserves 64 MiB of RLIMIT_AS
        return _run(cfg, env, stdin.encode("utf-8", "surrogatepass"), wall_s, max_output_bytes, token)
    finally:
        if uid is not None:
            uids.kill_uid(uid)
            uids.release_uid(uid)
        shutil.rmtree(root, onerror=_force_remove)


def _run(cfg: dict, env: dict, stdin: bytes, wall_s: float, cap: int, token: str) -> SandboxResult:
    start = time.monotonic()
    deadline = start + wall_s
    proc = subprocess.Popen([sys.executable, "-s", "-S", "-P", "-B", "-c", _BOOTSTRAP, json.dumps(cfg)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=cfg["root"], env=env, close_fds=True, start_new_session=True)
    try:
        out, err, stopped = _read_bounded(proc, stdin, deadline, cap)
        if stopped is None and not _wait_exit(proc.pid, deadline):
            stopped = "timeout"
    finally:
        _killpg(proc.pid)  # the leader is a zombie or alive, so its group id cannot have been reused
        proc.wait()
    elapsed = time.monotonic() - start
    rc = proc.returncode
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    if rc == SETUP_EXIT and stopped is None and token in stderr:
        raise SandboxError(stderr.replace(f"[{token}] ", "").strip())
    return SandboxResult(stopped or _STATUS.get(rc, "error"), rc, stdout, stderr, elapsed)


# exit code -> status; any other is "error". SIGXCPU / SIGKILL: RLIMIT_CPU (we kill only at wall_s)
_STATUS = {0: "ok", VIOLATION_EXIT: "violation", MEMORY_EXIT: "memory", DISK_EXIT: "output_limit",
           -signal.SIGXFSZ: "output_limit", -signal.SIGXCPU: "timeout", -signal.SIGKILL: "timeout"}


def _read_bounded(proc: subprocess.Popen, stdin: bytes, deadline: float, cap: int):
    """(stdout, stderr, stop reason or None): feed stdin, read both pipes until EOF, cap or deadline."""
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    try:
        for f in bufs:
            sel.register(f, selectors.EVENT_READ)
        if stdin:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        pos = 0
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), "timeout"
            for key, _ in sel.select(remaining):
                f = key.fileobj
                if f is proc.stdin:
                    try:
                        pos += os.write(f.fileno(), stdin[pos:pos + 65536])
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # it stopped reading: the rest of stdin is dropped
                        pos = len(stdin)
                    if pos >= len(stdin):
                        sel.unregister(f)
                        f.close()
                    continue
                chunk = os.read(f.fileno(), 65536)
                if not chunk:
                    sel.unregister(f)
                    continue
                buf = bufs[f]
                buf += chunk
                if len(buf) > cap:
                    del buf[cap:]
                    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), "output_limit"
        return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), None
    finally:
        sel.close()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            f.close()


def _wait_exit(pid: int, deadline: float) -> bool:
    """Whether ``pid`` exits before ``deadline``; it is left unreaped (``WNOWAIT``) for ``_killpg``."""
    delay = 0.0002
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.02)
    return True


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _force_remove(func, path, exc_info) -> None:
    """rmtree's error handler: the code may have left a directory without write or search permission."""
    if os.path.lexists(path):
        os.chmod(os.path.dirname(path), 0o700)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o700)
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)


# ---- privileges ------------------------------------------------------------------------------------

class Isolation(NamedTuple):
    """The kernel layers ``run_python`` gets in this process (see the module docstring)."""

    level: str
    """``root``: a uid of its own, network and mount namespaces; ``userns``: network and mount namespaces
    in an unprivileged user namespace, our own uid; ``none``: resource limits and the audit hook only."""
    missing: str
    """What a stronger level lacks here, one line ("" at ``root``)."""


def isolation() -> Isolation:
    """The isolation level of this process: ``root`` as root, else ``userns`` when an unprivileged user
    namespace with its network and mount namespaces can be set up (tried once per process), else ``none``."""
    if _privileged():
        return Isolation("root", "")
    refused = _userns_refused()
    if refused:
        return Isolation("none", f"not root (uid {os.getuid()}) and no unprivileged user namespace: {refused}")
    return Isolation("userns", f"not root (uid {os.getuid()}): the code runs as this uid")


@functools.lru_cache(maxsize=None)
def _userns_refused() -> str | None:
    """Why the ``userns`` layers cannot be set up here (the bootstrap's own failure), or None when they can."""
    try:
        result = _run_confined("pass", "userns", stdin="", wall_s=10.0, cpu_s=5.0, memory_mb=256,
                               max_output_bytes=4096, max_file_bytes=4096, max_processes=4)
    except (SandboxError, OSError) as exc:
        return " ".join(str(exc).replace("sandbox setup failed: ", "").split())
    return None if result.status == "ok" else f"a trial run ended {result.status}: {result.stderr.strip()[-200:]}"


_warned: set[str] = set()  # what _warn_no_isolation said already (once per process)
_warned_lock = threading.Lock()


def _warn_no_isolation() -> None:
    with _warned_lock:  # the code reward's threads start their first runs at once
        if "none" in _warned:
            return
        _warned.add("none")
    log.warning("code sandbox without kernel isolation (%s): model code runs under resource limits and the "
                "audit hook only", isolation().missing)


def _privileged() -> bool:
    """Whether runs get the root-only layers (own uid, namespaces); a function so tests can turn it off."""
    return os.geteuid() == 0


@functools.lru_cache(maxsize=None)
def _hidden_prefix() -> tuple[str, str] | None:
    """(blocker, prefix) when ``blocker``, the topmost ancestor of the interpreter's prefix that other users
    cannot search, would keep an unprivileged child from importing the standard library; else None."""
    prefix = os.path.realpath(sys.base_prefix)
    ancestors = [prefix] + [str(p) for p in pathlib.PurePath(prefix).parents]  # nearest first
    closed = [path for path in ancestors if not os.stat(path).st_mode & 0o001]  # no search bit for others
    return (closed[-1], prefix) if closed else None


# ---- the bootstrap: runs in the child, as root until it switches to the sandbox uid -----------------

_BOOTSTRAP = r"""
import os, sys


def _confine(cfg):
    import json, resource
    cfg = json.loads(cfg)
    root, uid, userns = cfg["root"], cfg["uid"], cfg["userns"]
    violation_exit, memory_exit, disk_exit, setup_exit = cfg["codes"]
    path = os.path.join(root, cfg["solution"])
    with open(path, "rb") as f:
        token, _, source = f.read().partition(b"\n")
    os.unlink(path)
    os.umask(0o022)
    if uid is not None or userns:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mount.argtypes = (ctypes.c_char_p,) * 3 + (ctypes.c_ulong, ctypes.c_char_p)

        def fail(what, why=None):
            why = why or os.strerror(ctypes.get_errno())
            os.write(2, ("[%s] sandbox setup failed: %s: %s\n" % (token.decode(), what, why)).encode())
            os._exit(setup_exit)

        def mount(src, dst, fstype, flags, data=None):
            enc = lambda s: None if s is None else s.encode()
            return libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) == 0

        MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = (
            1, 2, 4, 32, 4096, 8192, 16384, 1 << 18)
        if userns:  # not root: a user namespace of our own (our uid and gid mapped to themselves) owns the others
            if libc.unshare(0x10000000 | 0x40000000 | 0x00020000) != 0:  # CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS
                fail("unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS)")
            for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (os.getuid(), os.getuid())),
                               ("gid_map", "%d %d 1" % (os.getgid(), os.getgid()))):
                try:
                    with open("/proc/self/" + name, "w") as f:
                        f.write(text)
                except OSError as exc:
                    fail("writing /proc/self/" + name, exc.strerror)
        else:
            libc.unshare(0x40000000)  # CLONE_NEWNET; if refused, the audit hook still blocks sockets
        private = (userns or libc.unshare(0x00020000) == 0) and mount(None, "/", None, MS_REC | MS_PRIVATE)  # NEWNS
        if userns and not private:
            fail("making the mount namespace private")
        if cfg["reveal"]:
            blocker, prefix = cfg["reveal"]
            if not private:
                fail("%s is not readable by the sandbox uid and no mount namespace (CAP_SYS_ADMIN) to expose it"
                     % prefix)
            stage = os.path.join(root, ".prefix")
            os.mkdir(stage)
            if not (mount(prefix, stage, None, MS_BIND | MS_REC)
                    and mount("tmpfs", blocker, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")):
                fail("exposing " + prefix)
            os.makedirs(prefix, exist_ok=True)
            if not mount(stage, prefix, None, MS_MOVE):
                fail("exposing " + prefix)
        if private:
            attr = (ctypes.c_uint64 * 4)(1, 0, 0, 0)  # struct mount_attr: attr_set = MOUNT_ATTR_RDONLY
            # mount_setattr(AT_FDCWD, "/", AT_RECURSIVE, &attr, sizeof attr): every mount read-only
            if libc.syscall(442, -100, b"/", 0x8000, ctypes.byref(attr), ctypes.sizeof(attr)) != 0:
                mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY)  # kernels before 5.12: "/" only
            owner = (uid, uid) if uid is not None else (os.getuid(), os.getgid())
            opts = "size=%d,nr_inodes=1024,mode=0700,uid=%d,gid=%d" % ((cfg["fsize"],) + owner)
            if not mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, opts):
                fail("mounting the temp dir")
            os.chdir(root)  # the cwd still pointed at the directory under the new mount
    R = resource
    for limit, soft, hard in ((R.RLIMIT_CORE, 0, 0), (R.RLIMIT_FSIZE, cfg["fsize"], cfg["fsize"]),
                              (R.RLIMIT_NOFILE, cfg["nofile"], cfg["nofile"]),
                              (R.RLIMIT_NPROC, cfg["nproc"], cfg["nproc"]),
                              (R.RLIMIT_CPU, cfg["cpu"], cfg["cpu"] + 1),  # SIGXCPU, then SIGKILL a second later
                              (R.RLIMIT_AS, cfg["mem"], cfg["mem"])):
        current = R.getrlimit(limit)[1]
        if uid is None and current != R.RLIM_INFINITY:  # unprivileged: a hard limit can only go down
            hard = min(hard, current)
            soft = min(soft, hard)
        R.setrlimit(limit, (soft, hard))
    if uid is not None:
        try:
            for fd in (0, 1, 2):  # our pipes, so that open("/dev/stdout") works as the sandbox uid
                os.fchown(fd, uid, uid)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        except OSError as exc:
            fail("switching to uid %d" % uid, exc.strerror)
        if libc.prctl(38, 1, 0, 0, 0) != 0 or os.getresuid() != (uid,) * 3:  # PR_SET_NO_NEW_PRIVS
            fail("dropping privileges")
        libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE, cleared by the uid change: /proc/self/fd is ours again
    elif userns:  # drop the capabilities the user namespace gave (with them the code could undo the mounts)
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        if libc.capset(header, (ctypes.c_uint32 * 6)()) != 0 or libc.prctl(38, 1, 0, 0, 0) != 0:  # NO_NEW_PRIVS
            fail("dropping capabilities")
    if uid is not None or userns:
        del libc, fail, mount
        for name in [n for n in sys.modules if n in ("ctypes", "_ctypes") or n.startswith("ctypes.")]:
            del sys.modules[name]
    sys.addaudithook(_hook(os.path.realpath(root), os.getpid(), violation_exit))
    return source, memory_exit, disk_exit


def _hook(root, pid, violation_exit):
    import _stat
    deny = frozenset((
        "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
        "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo", "socket.sethostname",
        "urllib.Request", "os.system", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn",
        "subprocess.Popen", "os.link", "os.symlink", "sys.settrace", "sys.setprofile", "gc.get_objects",
        "gc.get_referrers", "gc.get_referents", "cpython.PyInterpreterState_New", "sqlite3.connect",
        "syslog.openlog", "syslog.syslog"))
    deny_import = frozenset((
        "_posixsubprocess", "ctypes", "_ctypes", "_sqlite3", "_multiprocessing", "_posixshmem", "readline",
        "syslog", "_curses", "_curses_panel", "_tkinter", "_dbm", "_gdbm", "ossaudiodev"))
    # event: (positions of its path arguments, positions of its dir_fd arguments)
    paths = {"os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)), "os.mkdir": ((0,), (2,)),
             "os.rename": ((0, 1), (2, 3)), "os.truncate": ((0,), ()), "os.chmod": ((0,), (2,)),
             "os.chown": ((0,), (3,)), "os.utime": ((0,), (3,)), "os.setxattr": ((0,), ()),
             "os.removexattr": ((0,), ()), "os.chflags": ((0,), ()), "os.lchflags": ((0,), ())}
    writable_devices = frozenset(("/dev/null", "/dev/stdout", "/dev/stderr"))
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC

    def absolute(p, _t=type, _s=str, _b=bytes, _getcwd=os.getcwd, _BE=BaseException):
        # p as a normalised absolute str; None unless an exact str/bytes, or when relative with a ".." (from
        # a dir_fd other than the cwd, such a path could land outside although it looks inside from here)
        if _t(p) is _b:
            p = _b.decode(p, "utf-8", "surrogateescape")
        elif _t(p) is not _s:
            return None
        relative = not _s.startswith(p, "/")
        try:
            full = _getcwd() + "/" + p if relative else p
        except _BE:  # the cwd was removed
            return None
        parts = []
        for part in _s.split(full, "/"):
            if part == "..":
                if relative:
                    return None
                if parts:
                    parts.pop()
            elif part and part != ".":
                parts.append(part)
        return "/" + "/".join(parts)

    def inside(p, _abs=absolute, _root=root, _under=root + "/", _s=str):
        p = _abs(p)
        return p is not None and (p == _root or _s.startswith(p, _under))

    def hook(event, args, _t=type, _s=str, _i=int, _deny=deny, _deny_import=deny_import, _paths=paths,
             _inside=inside, _abs=absolute, _osstat=os.stat, _isdir=_stat.S_ISDIR, _isfifo=_stat.S_ISFIFO,
             _ischr=_stat.S_ISCHR, _wflags=write_flags,
             _devices=writable_devices, _pid=pid, _write=os.write, _exit=os._exit, _code=violation_exit,
             _BE=BaseException):
        if _t(event) is not _s or event in _deny or _s.startswith(event, "ctypes."):
            blocked = True
        elif event == "socket.__new__":
            blocked = args[1] != 1  # AF_UNIX only
        elif event == "import":
            name = args[0]
            blocked = _t(name) is not _s or name in _deny_import or _s.startswith(name, ("_test", "_xx"))
        elif event == "open":
            target, flags, path = args[0], args[2], None
            if _t(target) is not _i:
                path = _abs(target)
            if _t(flags) is not _i:
                blocked = True
            elif _t(target) is _i:
                blocked = False  # an fd it already holds: stdin/stdout/stderr or a checked open
            elif path is None:
                blocked = True  # not a plain str/bytes path, or relative with ".."
            elif flags & _wflags:
                blocked = not _inside(path)
                if blocked and path in _devices:  # /dev/stdout is fd 1 reopened: a pipe, unless dup2'd over
                    try:
                        mode = _osstat(path).st_mode
                        blocked = not (_isfifo(mode) or _ischr(mode))
                    except _BE:
                        pass
            elif _inside(path):
                blocked = False
            else:  # reading outside is fine, but not a directory: a dir_fd would get around the path check
                try:
                    blocked = _isdir(_osstat(path).st_mode)
                except _BE:
                    blocked = False
        elif event in _paths:
            where, dir_fds = _paths[event]
            blocked = False
            for i in where:
                if _t(args[i]) is _i:  # by fd (fchmod & co.): only ftruncate, on an fd opened for writing
                    blocked = blocked or event != "os.truncate"
                else:
                    blocked = blocked or not _inside(args[i])
            for i in dir_fds:
                blocked = blocked or not (args[i] is None or (_t(args[i]) is _i and args[i] == -1))
        elif event == "os.kill" or event == "os.killpg":
            blocked = not (_t(args[0]) is _i and (args[0] == _pid or args[0] == 0))
        else:
            blocked = False
        if blocked:
            try:
                what = event if _t(event) is _s else "?"
                if (what == "open" or what == "import") and _t(args[0]) is _s:
                    what = what + " " + args[0]
                _write(2, b"\nsandbox: blocked " + _s.encode(what, "utf-8", "replace") + b"\n")
            except _BE:
                pass
            _exit(_code)

    return hook


def _main():
    source, memory_exit, disk_exit = _confine(sys.argv[1])
    del globals()["_confine"], globals()["_hook"]
    module = type(sys)("__main__")
    sys.modules["__main__"] = module
    sys.argv[:] = ["<solution>"]
    try:
        exec(compile(source, "<solution>", "exec"), module.__dict__)
    except MemoryError:
        os.write(2, b"MemoryError\n")
        os._exit(memory_exit)
    except OSError as exc:
        if exc.errno in (27, 28):  # EFBIG (RLIMIT_FSIZE), ENOSPC (the temp dir's tmpfs is full)
            os.write(2, ("OSError: [Errno %d] %s\n" % (exc.errno, exc.strerror)).encode())
            os._exit(disk_exit)
        raise


_main()
"""
