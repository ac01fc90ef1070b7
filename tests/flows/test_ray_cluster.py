"""A persistent Ray cluster (`ray start --head` on 127.0.0.1): engines are detached named actors, so a
second flow run of the same run name — here, the rerun after its driver was SIGKILLed — reattaches to
the same actors (same actor ids and pids) instead of loading the models again."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from services import REPO_ROOT, base_env, free_port, process_group, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # its own Ray head and two CLI runs


@pytest.fixture()
def ray_head(tmp_path):
    """A head node with Ray's token authentication (the default of `ray start` since 2.5x): drivers need
    RAY_AUTH_MODE=token and the token (here a file of this test's own)."""
    port = free_port()
    ray_tmp = tempfile.mkdtemp(prefix="rf-ray-", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    token = tmp_path / "ray-token"
    token.write_text(os.urandom(32).hex())
    env = base_env(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
           "--port", str(port), "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats",
           "--temp-dir", ray_tmp]
    # --block keeps `ray start` in the foreground: stopping its process group stops this cluster only
    # (`ray stop` would stop every Ray on the machine, the test session's own included).
    with process_group(cmd, env, tmp_path / "ray-head.log") as proc:
        address = f"127.0.0.1:{port}"
        probe = [sys.executable, "-c", f"import ray; ray.init(address='{address}'); print(ray.cluster_resources())"]
        log = tmp_path / "ray-head.log"
        wait_for(lambda: proc.poll() is not None or "Ray runtime started" in log.read_text(), 120, "the Ray head")
        assert proc.poll() is None, log.read_text()[-2000:]
        joined = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=120)
        assert joined.returncode == 0 and "'CPU': 2.0" in joined.stdout, joined.stderr[-2000:]
        (tmp_path / "wrong-token").write_text("0" * 64)
        refused = subprocess.run(probe, env={**env, "RAY_AUTH_TOKEN_PATH": str(tmp_path / "wrong-token")},
                                 capture_output=True, text=True, timeout=120)
        assert refused.returncode != 0 and "AuthenticationError" in refused.stderr  # no token, no cluster
        yield address, env
    shutil.rmtree(ray_tmp, ignore_errors=True)


def test_rerun_reattaches_to_the_same_engine_actors(ray_head, prefect_api, tmp_path):
    _, prefect_env = prefect_api
    run_dir = tmp_path / "run"
    address, ray_env = ray_head
    env = {**prefect_env, "RAY_ADDRESS": address, "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN_PATH": ray_env["RAY_AUTH_TOKEN_PATH"], "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    cmd = [sys.executable, "-m", "flows.cli", "run", "tiny", f"run.dir={run_dir}", "run.name=persistent",
           "train.steps=6", "checkpoint.every=2", "eval.every=0", "tracking.sample_every=0"]

    first = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: (run_dir / "checkpoints" / "step_000002" / "MANIFEST.json").exists(), 300, "the first checkpoint")
    engines_first = json.loads((run_dir / "engines.json").read_text())
    first.send_signal(signal.SIGKILL)
    first.wait()

    listed = subprocess.run([sys.executable, "-m", "flows.cli", "engines", "list", "persistent"], env=env,
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    roles = sorted(line.split("/", 1)[1].split("#")[0] for line in listed.stdout.split())
    assert roles == ["reward-0", "rollout", "trainer"], listed  # outlived their driver

    second = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=400)
    assert second.returncode == 0, second.stderr[-3000:]
    engines_second = json.loads((run_dir / "engines.json").read_text())
    assert set(engines_second) == {"rollout", "trainer", "reward"}
    for role, where in engines_first.items():
        assert engines_second[role] == where, role  # same actor id and pid: reattached, no model reload
    state = json.loads((run_dir / "final" / "state.json").read_text())
    assert state["step"] == 6 and len(state["resumed_from"]) == 1 and state["resumed_from"][0] >= 2

    stopped = subprocess.run([sys.executable, "-m", "flows.cli", "engines", "list", "persistent"], env=env,
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 0 and stopped.stdout.strip() == ""  # a finished run frees the cluster
