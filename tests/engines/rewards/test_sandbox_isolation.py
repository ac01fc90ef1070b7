"""The sandbox's isolation level without root: unprivileged user namespaces where the kernel allows them,
checked from the outside as a real non-root user; and where no isolation is possible, a code reward is
refused at config load unless reward.allow_unsandboxed_code opts in."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import secrets
import shutil
import socket
import subprocess
import sys

import pytest

import engines.rewards.sandbox as sandbox
from configs.schema import Config
from engines.rewards.code import code_reward

REPO = pathlib.Path(__file__).resolve().parents[3]
NOBODY = 65534

# Runs as a non-root user. It imports the sandbox without the packages' __init__ (they import torch & co.,
# which that user's interpreter may lack; the sandbox needs the standard library only). "block": first
# enter a user namespace of our own that allows no nested one, as a kernel refusing them would.
AS_USER = r"""
import ctypes, importlib, json, os, sys, types
repo, port, target, block = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "block"
for name in ("engines", "engines.rewards"):
    package = types.ModuleType(name)
    package.__path__ = [os.path.join(repo, *name.split("."))]
    sys.modules[name] = package
if block:
    assert ctypes.CDLL(None, use_errno=True).unshare(0x10000000) == 0  # CLONE_NEWUSER
    for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", "%d %d 1" % ((os.getuid(),) * 2)),
                       ("/proc/self/gid_map", "%d %d 1" % ((os.getgid(),) * 2)), ("/proc/sys/user/max_user_namespaces", "0")):
        with open(path, "w") as f:
            f.write(text)
sandbox = importlib.import_module("engines.rewards.sandbox")
out = {"uid": os.getuid(), "isolation": list(sandbox.isolation())}
out["plain"] = sandbox.run_python("import os\nprint(os.getuid())").stdout.strip()
if not block:  # the kernel layers alone: the audit hook taken out
    sandbox._BOOTSTRAP = sandbox._BOOTSTRAP.replace("sys.addaudithook(_hook(", "(_hook(")
    code = ("import os, socket\n"
            "try:\n    socket.create_connection(('127.0.0.1', %d), timeout=1)\nexcept OSError as exc:\n    print('connect', exc.errno)\n"
            "try:\n    open(%r, 'w')\nexcept OSError as exc:\n    print('open', exc.errno)\n"
            "open('inside', 'w').write('x')\n"
            "print('caps', open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n") % (port, target)
    result = sandbox.run_python(code)
    out["kernel"] = [result.status] + result.stdout.splitlines()
print(json.dumps(out))
"""


def _python_for(user: list[str]) -> str | None:
    """An interpreter (3.11+, for -P) that ``user`` (a command prefix) can run, and the sandbox start again
    by its ``sys.executable``; or None."""
    for python in dict.fromkeys([sys.executable, shutil.which("python3") or "", "/usr/bin/python3"]):
        if python and subprocess.run(user + [python, "-c", "import os, sys; assert sys.version_info >= (3, 11) and os.access(sys.executable, os.X_OK)"],
                                     capture_output=True, cwd="/").returncode == 0:
            return python
    return None


def run_unprivileged(mode: str, port: int = 9, target: str = "/nonexistent/x") -> dict:
    """AS_USER's report, run by the current user if not root, else as nobody (setpriv drops root)."""
    user = []
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("no setpriv to drop root")
        user = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    python = _python_for(user)
    if python is None:
        pytest.skip("no Python >= 3.11 that the unprivileged user can run")
    proc = subprocess.run(user + [python, "-c", AS_USER, str(REPO), str(port), target, mode],
                          capture_output=True, text=True, cwd="/", timeout=60)
    assert proc.returncode == 0, proc.stderr
    return {**json.loads(proc.stdout), "stderr": proc.stderr}


def test_without_root_a_user_namespace_gives_the_network_and_mount_layers():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    target = f"/tmp/escape-{secrets.token_hex(8)}"  # /tmp is world-writable: only a read-only mount stops it
    try:
        report = run_unprivileged("open", server.getsockname()[1], target)
    finally:
        server.close()
    level, missing = report["isolation"]
    if level != "userns":
        pytest.skip(f"this kernel refuses unprivileged user namespaces: {missing}")
    assert report["uid"] != 0 and report["plain"] == str(report["uid"])  # the code keeps our uid
    assert missing == f"not root (uid {report['uid']}): the code runs as this uid"
    # ENETUNREACH: a network namespace of its own; EROFS: every mount read-only, its temp dir the one
    # writable place; no capability left that could undo either
    assert report["kernel"] == ["ok", "connect 101", "open 30", "caps 0000000000000000"]
    assert not os.path.exists(target)


def test_where_the_kernel_refuses_user_namespaces_the_level_is_none_and_code_still_runs():
    report = run_unprivileged("block")
    level, missing = report["isolation"]
    assert level == "none"
    assert missing.startswith(f"not root (uid {report['uid']}) and no unprivileged user namespace: unshare(")
    assert missing.endswith("No space left on device")  # the kernel's answer past max_user_namespaces
    assert report["plain"] == str(report["uid"])
    assert report["stderr"].count("code sandbox without kernel isolation") == 1  # warned once, not per run


def test_isolation_levels(monkeypatch):
    monkeypatch.setattr(sandbox, "_privileged", lambda: True)
    assert sandbox.isolation() == ("root", "")
    monkeypatch.setattr(sandbox, "_privileged", lambda: False)
    monkeypatch.setattr(sandbox, "_userns_refused", lambda: None)
    assert sandbox.isolation().level == "userns"
    monkeypatch.setattr(sandbox, "_userns_refused", lambda: "unshare(...): Operation not permitted")
    assert sandbox.isolation() == ("none", f"not root (uid {os.getuid()}) and no unprivileged user namespace: "
                                           "unshare(...): Operation not permitted")


CODE_DOMAIN = {"name": "code", "reward": "code", "share": 8, "train_path": __file__, "heldout_path": __file__}


def code_config(single_domain: bool = False, **reward) -> dict:
    if single_domain:
        return {"reward": {"name": "code", **reward}}
    return {"data": {"source": "domains", "domains": [CODE_DOMAIN]}, "reward": reward}


@pytest.fixture
def no_isolation(monkeypatch):
    monkeypatch.setattr(sandbox, "_privileged", lambda: False)
    monkeypatch.setattr(sandbox, "_userns_refused", lambda: "unshare(CLONE_NEWUSER): Operation not permitted")


@pytest.mark.parametrize("single_domain", [False, True])
def test_a_code_reward_without_isolation_is_refused_in_one_line(no_isolation, single_domain):
    with pytest.raises(ValueError) as raised:
        Config.model_validate(code_config(single_domain))
    [error] = raised.value.errors()
    message = error["msg"]
    assert "\n" not in message
    assert message == (
        f"Value error, reward 'code' runs model-written code, but the sandbox gets no kernel isolation here (not root "
        f"(uid {os.getuid()}) and no unprivileged user namespace: unshare(CLONE_NEWUSER): Operation not permitted); "
        "run as root or where unprivileged user namespaces are allowed, or set reward.allow_unsandboxed_code=true to "
        "confine it by rlimits and an audit hook only")
    Config.model_validate({"data": {"source": "domains", "domains": [{**CODE_DOMAIN, "reward": "math"}]}})  # not code


def test_a_weighted_reward_with_a_code_component_is_refused_too(no_isolation):
    weighted = {**CODE_DOMAIN, "reward": "weighted", "reward_options": {"components": "math:0.5,code:0.5"}}
    with pytest.raises(ValueError, match="reward 'code' runs model-written code"):
        Config.model_validate({"data": {"source": "domains", "domains": [weighted]}})
    harmless = {**weighted, "reward_options": {"components": "math:0.5,think_answer_format:0.5"}}
    Config.model_validate({"data": {"source": "domains", "domains": [harmless]}})


def test_the_opt_in_lets_a_code_reward_run_without_isolation(no_isolation, caplog):
    assert Config.model_validate(code_config(allow_unsandboxed_code=True)).reward.allow_unsandboxed_code
    sandbox._warned.clear()
    with caplog.at_level(logging.WARNING, logger="engines.rewards.sandbox"):
        scored = code_reward(["add"], ["```python\ndef add(a, b):\n    return a + b\n```"],
                             tests=[["assert add(1, 2) == 3", "assert add(2, 2) == 5"]])
    assert scored.rewards == [0.5]  # one of two asserts holds
    assert [r.getMessage() for r in caplog.records] == [
        f"code sandbox without kernel isolation (not root (uid {os.getuid()}) and no unprivileged user namespace: "
        "unshare(CLONE_NEWUSER): Operation not permitted): model code runs under resource limits and the audit hook only"]
    sandbox._warned.clear()


@pytest.mark.parametrize("level", ["root", "userns"])
def test_a_code_reward_with_isolation_needs_no_opt_in(monkeypatch, level):
    monkeypatch.setattr(sandbox, "isolation", lambda: sandbox.Isolation(level, ""))
    assert Config.model_validate(code_config()).data.domains[0].reward == "code"
