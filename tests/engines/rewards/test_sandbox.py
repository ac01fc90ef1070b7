"""The sandbox's limits, each provoked by code that breaks it, checked from the outside (/proc, the file
system, a listening socket) rather than by trusting what the sandbox reports."""

import doctest
import os
import secrets
import signal
import socket
import subprocess
import threading
import time

import pytest

import engines.rewards.sandbox as sandbox
from engines.rewards.sandbox import MEMORY_EXIT, VIOLATION_EXIT, run_python

ROOT = os.geteuid() == 0
root_only = pytest.mark.skipif(not ROOT, reason="the uid switch and the namespaces need root")
namespaced = pytest.mark.skipif(sandbox.isolation().level == "none",
                                reason="the namespaces need root or unprivileged user namespaces")


def live_pids(uid=None, session=None):
    """Live processes with ``uid`` among their uids, or in ``session``, read straight from /proc."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            with open(f"/proc/{name}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()  # state ppid pgrp session ...
        except OSError:
            continue
        if status["State"].split()[0] == "Z":
            continue
        if (uid is not None and uid in {int(x) for x in status["Uid"].split()}) or (
                session is not None and int(stat[3]) == session):
            found.append(int(name))
    return found


def test_normal_run_output_and_stdin():
    result = run_python("import sys\nprint(sum(range(10)))\nprint(sys.stdin.read()[::-1], end='')", stdin="abc")
    assert (result.status, result.returncode, result.stdout, result.stderr) == ("ok", 0, "45\ncba", "")
    assert 0 < result.wall_s < 5


def test_exception_is_error_with_traceback():
    result = run_python("raise ValueError('boom')")
    assert result.status == "error" and result.returncode == 1
    assert result.stderr.rstrip().endswith("ValueError: boom")


def test_large_stdin_is_fed_while_reading():
    # 300 kB does not fit a pipe buffer: stdin must be written while stdout is read, or both block.
    result = run_python("import sys\ndata = sys.stdin.read()\nprint(len(data))\nprint(data)", stdin="x" * 300_000,
                        max_output_bytes=400_000)
    assert result.status == "ok" and result.stdout.split("\n", 1)[0] == "300000"


def test_fork_bomb_is_contained_and_leaves_no_process():
    code = "import os\nprint(os.getuid(), os.getsid(0), flush=True)\nwhile True: os.fork()"
    start = time.monotonic()
    result = run_python(code, wall_s=3)
    assert time.monotonic() - start < 3 + 3
    assert result.status != "ok"
    assert result.status == "violation"  # the audit hook refuses os.fork before the first one
    uid, session = (int(x) for x in result.stdout.split())
    if ROOT:
        assert uid not in (0, os.getuid())  # it ran as a uid of its own
        assert live_pids(uid=uid) == []
    assert live_pids(session=session) == []


@root_only
def test_process_limit_is_enforced_by_the_kernel():
    # Threads count against RLIMIT_NPROC of the sandbox uid: with max_processes=8 the 8th task (7 threads
    # besides the main one) cannot start. No audit hook is involved: thread creation raises no event.
    # memory_mb is high so that RLIMIT_AS (8 MiB of stack per thread) is not the limit that stops them.
    code = ("import threading, time\nstarted = 0\ntry:\n    for _ in range(50):\n"
            "        threading.Thread(target=time.sleep, args=(2,), daemon=True).start()\n        started += 1\n"
            "except RuntimeError as exc:\n    print(started, exc)\n")
    result = run_python(code, max_processes=8, memory_mb=4096)
    assert result.status == "ok"
    assert result.stdout.strip() == "7 can't start new thread"


@root_only
def test_kernel_layers_alone_contain_fork_bomb_network_and_writes(monkeypatch, listener):
    # The audit hook taken out: what is left (own uid + RLIMIT_NPROC, process-group kill and uid sweep,
    # network namespace, read-only mounts) must still hold.
    assert "sys.addaudithook(_hook(" in sandbox._BOOTSTRAP
    monkeypatch.setattr(sandbox, "_BOOTSTRAP", sandbox._BOOTSTRAP.replace("sys.addaudithook(_hook(", "(_hook("))
    port = listener.getsockname()[1]
    target = f"/tmp/escape-{secrets.token_hex(8)}"
    code = (f"import os, socket\nprint(os.getuid(), os.getsid(0), flush=True)\n"
            f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\nexcept OSError as exc:\n"
            f"    print('connect', exc.errno, flush=True)\n"
            f"try:\n    open({target!r}, 'w')\nexcept OSError as exc:\n    print('open', exc.errno, flush=True)\n"
            "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    start = time.monotonic()
    result = run_python(code, wall_s=2, max_processes=16)
    assert time.monotonic() - start < 2 + 3
    assert result.status == "timeout"
    ids, connect, opened = result.stdout.splitlines()[:3]
    assert connect == "connect 101"  # ENETUNREACH: the namespace's loopback is down
    assert opened == "open 30"  # EROFS
    assert_never_accepted(listener)
    assert not os.path.exists(target)
    uid, session = (int(x) for x in ids.split())
    assert live_pids(uid=uid) == [] and live_pids(session=session) == []


@root_only
def test_leftover_processes_of_a_sandbox_uid_are_killed():
    # A process of the uid outside the sandbox's process group (what an escaped child would be).
    uid = sandbox.uids.claim_uid()
    try:
        proc = subprocess.Popen(["sleep", "30"], user=uid, group=uid, start_new_session=True)
        assert live_pids(uid=uid) == [proc.pid]
        sandbox.uids.kill_uid(uid)
        assert proc.wait(timeout=5) == -signal.SIGKILL
        assert live_pids(uid=uid) == []
    finally:
        sandbox.uids.release_uid(uid)


def test_infinite_loop_times_out_on_the_wall_clock():
    start = time.monotonic()
    result = run_python("while True: pass", wall_s=1, cpu_s=10)
    assert time.monotonic() - start < 1 + 2
    assert (result.status, result.returncode) == ("timeout", -signal.SIGKILL)


def test_sleeping_forever_times_out():
    result = run_python("import time\ntime.sleep(100)", wall_s=1)
    assert (result.status, result.returncode) == ("timeout", -signal.SIGKILL)
    assert result.wall_s < 3


def test_cpu_limit_stops_a_loop_before_the_wall_clock():
    result = run_python("while True: pass", wall_s=10, cpu_s=1)
    assert (result.status, result.returncode) == ("timeout", -signal.SIGXCPU)
    assert result.wall_s < 4


def test_big_allocation_is_a_memory_error():
    result = run_python("x = bytearray(10**10)", memory_mb=256)
    assert (result.status, result.returncode) == ("memory", MEMORY_EXIT)
    assert "MemoryError" in result.stderr


def test_allocation_under_the_limit_works():
    result = run_python("x = bytearray(100 * 2**20)\nprint(len(x))", memory_mb=256)
    assert (result.status, result.stdout) == ("ok", f"{100 * 2**20}\n")


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    yield server
    server.close()


def assert_never_accepted(server):
    time.sleep(0.1)
    with pytest.raises(BlockingIOError):
        server.accept()


@pytest.mark.parametrize("code", [
    "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)",
    "import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))",
    "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}/', timeout=2)",
    "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\ns.sendto(b'x', ('127.0.0.1', {port}))",
])
def test_network_is_a_violation_and_nothing_connects(listener, code):
    result = run_python(code.format(port=listener.getsockname()[1]))
    assert (result.status, result.returncode) == ("violation", VIOLATION_EXIT)
    assert "sandbox: blocked" in result.stderr
    assert_never_accepted(listener)


@namespaced
def test_network_namespace_has_only_loopback():
    # /proc/net/dev lists the interfaces of the reader's network namespace.
    result = run_python("print(sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))")
    assert result.stdout.strip() == "['lo']"


def test_writing_outside_its_dir_is_a_violation(tmp_path):
    targets = [f"/tmp/escape-{secrets.token_hex(8)}", str(tmp_path / "escape"), f"../escape-{secrets.token_hex(8)}"]
    for target in targets:
        result = run_python(f"open({target!r}, 'w').write('x')")
        assert result.status == "violation", target
        assert not os.path.exists(target)
    assert os.listdir(tmp_path) == []


def test_path_tricks_are_violations(tmp_path):
    escape = str(tmp_path / "escape")
    for code in [
        f"import os\nos.close(os.open({escape!r}, os.O_WRONLY | os.O_CREAT))",  # os.open, not open()
        "import os\nfd = os.open('/tmp', os.O_RDONLY)\nos.open('escape', os.O_WRONLY | os.O_CREAT, dir_fd=fd)",
        # a dir fd of the temp dir, the cwd one level down: '../x' looks inside from the cwd, is outside
        "import os\nos.mkdir('a')\nopen('tmp', 'w').close()\nfd = os.open('.', os.O_RDONLY)\nos.chdir('a')\n"
        "os.open('../tmp', os.O_RDONLY, dir_fd=fd)",
        f"import os\nos.symlink({escape!r}, 'link')\nopen('link', 'w')",
        f"import os\nopen('a', 'w').close()\nos.rename('a', {escape!r})",
        f"import os.path\nos.path.realpath = lambda p: p\nopen({escape!r}, 'w')",  # the hook does not use os.path
        "import sys\nsys.settrace(lambda *a: None)",  # a tracer could jump over the hook's lines
        # /dev/stdout reopens fd 1: made a read-only file, it must not become writable that way
        "import os\nos.dup2(os.open('/etc/hostname', os.O_RDONLY), 1)\nopen('/dev/stdout', 'w')",
    ]:
        assert run_python(code).status == "violation", code
    assert os.listdir(tmp_path) == []


@namespaced
def test_file_system_outside_its_dir_is_read_only():
    # os.mkfifo raises no audit event; the read-only mount namespace is what stops it.
    target = f"/tmp/fifo-{secrets.token_hex(8)}"
    result = run_python(f"import os\ntry:\n    os.mkfifo({target!r})\nexcept OSError as exc:\n    print(exc.errno)")
    assert result.stdout.strip() == "30"  # EROFS
    assert not os.path.exists(target)


def test_files_inside_its_dir_work_and_the_dir_is_deleted():
    code = ("import os, tempfile, pathlib\nprint(os.getcwd())\nopen('a.txt', 'w').write('hi')\n"
            "pathlib.Path('b.txt').write_text(open('a.txt').read())\nos.mkdir('d')\n"
            "with tempfile.NamedTemporaryFile('w', delete=False) as f: f.write('x')\n"
            "print(sorted(os.listdir('.')), os.path.dirname(f.name) == os.getcwd(), os.environ['HOME'] == os.getcwd())")
    result = run_python(code)
    assert result.status == "ok", result.stderr
    cwd, listing = result.stdout.splitlines()
    assert listing.startswith("['a.txt', 'b.txt', 'd', 'tmp") and listing.endswith("True True")
    assert not os.path.exists(cwd)


def test_filling_the_disk_is_stopped_and_cleaned_up():
    code = "import os\nprint(os.getcwd(), flush=True)\nopen('big', 'wb').write(b'0' * 10**9)"
    result = run_python(code)
    assert result.status != "ok"
    assert result.status == "memory"  # the 1 GB bytes object already exceeds RLIMIT_AS
    assert not os.path.exists(result.stdout.strip())


def test_a_file_past_max_file_bytes_is_output_limit():
    code = "import os\nprint(os.getcwd(), flush=True)\nf = open('big', 'wb')\nwhile True: f.write(b'0' * 10**5)"
    result = run_python(code, max_file_bytes=1_000_000)
    assert result.status == "output_limit"
    assert "File too large" in result.stderr  # EFBIG from RLIMIT_FSIZE
    assert not os.path.exists(result.stdout.strip())


@namespaced
def test_many_small_files_fill_only_the_private_tmpfs():
    code = "i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'0' * 200_000)\n    i += 1"
    result = run_python(code, max_file_bytes=1_000_000)
    assert result.status == "output_limit"
    assert "No space left on device" in result.stderr


def test_output_flood_is_cut_at_the_cap():
    start = time.monotonic()
    result = run_python("while True: print('x' * 100)", max_output_bytes=64_000)
    assert time.monotonic() - start < 3
    assert result.status == "output_limit"
    assert 0 < len(result.stdout) <= 64_000


def test_stderr_flood_is_cut_at_the_cap():
    result = run_python("import sys\nwhile True: sys.stderr.write('e' * 100)", max_output_bytes=10_000)
    assert result.status == "output_limit" and len(result.stderr) <= 10_000


def test_environment_is_built_from_scratch(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "sekrit-value-123")
    result = run_python("import os\nprint(dict(os.environ))")
    assert "AWS_SECRET_ACCESS_KEY" not in result.stdout and "sekrit-value-123" not in result.stdout
    env = eval(result.stdout)  # our own child's repr of a dict of str
    assert sorted(env) == ["HOME", "LANG", "MALLOC_ARENA_MAX", "PATH", "PYTHONHASHSEED", "PYTHONUTF8", "TMPDIR"]
    assert env["HOME"] == env["TMPDIR"] and env["PYTHONHASHSEED"] == "0"


def test_string_hashing_is_deterministic():
    # PYTHONHASHSEED=0 takes effect (it would not under -I): set order is the same every run.
    code = "print(hash('abc'), list({'apple', 'banana', 'cherry', 'date'}))"
    assert run_python(code).stdout == run_python(code).stdout


def test_isolated_sys_path():
    # No cwd entry, no user site, no site-packages: only the standard library.
    result = run_python("import sys\nprint(sys.flags.no_site, sys.flags.no_user_site, sys.flags.safe_path, "
                        "any('site-packages' in p for p in sys.path))")
    assert result.stdout.strip() == "1 1 True False"


@pytest.mark.parametrize("code", [
    "import subprocess\nsubprocess.run(['ls'])",
    "import os\nos.system('ls')",
    "import os\nos.execv('/bin/ls', ['ls'])",
    "import os\nos.posix_spawn('/bin/ls', ['ls'], {})",
    "import os\nos.kill(1, 0)",
])
def test_spawning_and_signalling_others_is_a_violation(code):
    result = run_python(code)
    assert (result.status, result.returncode) == ("violation", VIOLATION_EXIT)


@pytest.mark.parametrize("code", ["import ctypes\nctypes.CDLL(None)", "import _ctypes"])
def test_ctypes_is_a_violation(code):
    assert run_python(code).status == "violation"


def test_a_caught_permission_error_is_still_a_violation():
    # The hook ends the process: catching the refusal does not let the code carry on.
    result = run_python("try:\n    open('/tmp/x-escape', 'w')\nexcept BaseException:\n    print('carried on')")
    assert result.status == "violation" and "carried on" not in result.stdout


def test_dev_null_and_dev_stdout_are_writable():
    code = "print('a', file=open('/dev/null', 'w'))\nopen('/dev/stdout', 'w').write('to stdout\\n')"
    assert run_python(code).stdout == "to stdout\n"


def test_a_forged_setup_failure_is_just_an_error():
    # Only the bootstrap knows the run's token, so the code cannot make run_python raise SandboxError.
    code = f"import sys\nsys.stderr.write('sandbox setup failed: x')\nsys.exit({sandbox.SETUP_EXIT})"
    assert run_python(code).status == "error"


@root_only
def test_a_real_setup_failure_raises(monkeypatch):
    monkeypatch.setattr(sandbox, "_hidden_prefix", lambda: ("/nonexistent-blocker", "/nonexistent-prefix"))
    with pytest.raises(sandbox.SandboxError, match="sandbox setup failed: exposing /nonexistent-prefix"):
        run_python("print(1)")


def test_without_kernel_isolation_the_uid_and_the_audit_hook_stay(monkeypatch, tmp_path):
    # isolation "none"; test_sandbox_isolation.py runs the "userns" level as a real non-root user
    monkeypatch.setattr(sandbox, "_privileged", lambda: False)
    monkeypatch.setattr(sandbox, "_userns_refused", lambda: "refused for this test")
    result = run_python("import os\nprint(os.getuid())")
    assert (result.status, result.stdout.strip()) == ("ok", str(os.getuid()))
    assert run_python(f"open({str(tmp_path / 'x')!r}, 'w')").status == "violation"
    assert os.listdir(tmp_path) == []


@root_only
def test_concurrent_runs_get_distinct_uids():
    results = []
    threads = [threading.Thread(target=lambda: results.append(run_python("import os, time\ntime.sleep(0.3)\n"
                                                                         "print(os.getuid())")))
               for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert [r.status for r in results] == ["ok"] * 6
    assert len({r.stdout for r in results}) == 6


def test_invalid_limits():
    with pytest.raises(ValueError, match="must be positive"):
        run_python("pass", wall_s=0)
    with pytest.raises(ValueError, match="max_processes=0"):
        run_python("pass", max_processes=0)


def test_docstring_examples():
    result = doctest.testmod(sandbox)
    assert result.attempted > 0 and result.failed == 0
