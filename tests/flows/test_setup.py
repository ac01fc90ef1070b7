"""The embedded Prefect server runs under SCHED_IDLE: every thread it has, and those it starts later."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from flows.setup import deprioritize

CHILD = """
import sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # started before deprioritize
print("ready", flush=True)
sys.stdin.readline()
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # started after: inherits it
print("started", flush=True)
time.sleep(60)
"""


def _policies(pid: int) -> list[int]:
    policies = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        fields = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        policies.append(int(fields[38]))  # field 41 of stat(5): the scheduling policy
    return policies


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux-only")
def test_deprioritize_puts_every_thread_of_a_process_under_sched_idle():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        before = _policies(child.pid)
        assert len(before) >= 2 and set(before) == {os.SCHED_OTHER}
        deprioritize(child.pid)
        assert set(_policies(child.pid)) == {os.SCHED_IDLE}
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "started"
        after = _policies(child.pid)
        assert len(after) == len(before) + 1 and set(after) == {os.SCHED_IDLE}
    finally:
        child.kill()
        child.wait()
