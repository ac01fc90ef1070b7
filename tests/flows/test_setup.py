"""The embedded Prefect server runs under SCHED_IDLE (every thread it has, and those it starts later)
and records task runs in batches without losing any when it stops; Ray workers (the engines) get a
short OpenMP spin unless the user set one."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from flows.setup import GOMP_SPINCOUNT, deprioritize, worker_env_vars

REPO = Path(__file__).resolve().parents[2]

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


SERVER_CHILD = """
import os
from prefect import flow, task
from prefect.server.api.server import SubprocessASGIServer
from flows.setup import start_prefect_server
from tasks.common import TASK_DEFAULTS

@task(name="unit", **TASK_DEFAULTS)
def unit(i):
    return i

@flow(name="many-tasks", persist_result=False)
def many(n):
    return sum(unit(i) for i in range(n))

start_prefect_server(timeout=120)
pid = SubprocessASGIServer().server_process.pid
server_env = dict(item.split("=", 1) for item in open(f"/proc/{pid}/environ").read().split("\\0") if "=" in item)
keys = ("PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE", "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL")
print(*[server_env.get(key) for key in keys], keys[0] in os.environ, flush=True)  # ours, the user's, not here
print(many(40), flush=True)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads the server's environment from /proc")
@pytest.mark.slow  # kept out of the default suite's ~12 minutes
def test_embedded_server_batches_task_runs_and_writes_every_one_when_it_stops(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path), PREFECT_SERVER_ALLOW_EPHEMERAL_MODE="true", PYTHONPATH=str(REPO),
               # set by the user: wins over EMBEDDED_SERVER_SETTINGS. 30 s: no periodic flush during the run,
               # so the 120 task-run events (under one batch of 200) reach the database only on stop
               PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL="30")
    done = subprocess.run([sys.executable, "-c", SERVER_CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    settings_line, total = done.stdout.split("\n")[:2]
    batch_size, flush_interval, left_in_env = settings_line.split()
    assert (batch_size, float(flush_interval), left_in_env) == ("200", 30.0, "False")
    assert total == str(sum(range(40)))
    with sqlite3.connect(tmp_path / "prefect.db") as db:
        states = db.execute("SELECT state_type, count(*) FROM task_run GROUP BY state_type").fetchall()
    assert states == [("COMPLETED", 40)]


RAY_CHILD = """
import os, ray
from flows.setup import ensure_ray
ensure_ray()
environment = ray.remote(lambda: (os.environ.get("GOMP_SPINCOUNT"), os.environ.get("TOKENIZERS_PARALLELISM")))
print(*ray.get(environment.remote()))
ray.shutdown()
"""


def test_ray_workers_get_a_short_openmp_spin_unless_the_user_set_one(tmp_path):
    assert worker_env_vars({})["GOMP_SPINCOUNT"] == GOMP_SPINCOUNT == "30000"  # libgomp's default is 300000
    assert worker_env_vars({"GOMP_SPINCOUNT": "300000"})["GOMP_SPINCOUNT"] == "300000"
    # a local Ray started by ensure_ray hands it to its workers, which read it when torch loads libgomp
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "RAY_ADDRESS")}
    env.update(PYTHONPATH=str(REPO), RAY_USAGE_STATS_ENABLED="0")
    done = subprocess.run([sys.executable, "-c", RAY_CHILD], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[-2] == "30000 false"
