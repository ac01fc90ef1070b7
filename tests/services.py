"""Real servers for tests, on 127.0.0.1 only: started as process groups, stopped (and reaped) after."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.25):
    """Poll ``predicate`` until it returns something truthy; fail the test naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def kill_when_written(proc: subprocess.Popen, path: Path, timeout_s: float) -> None:
    """SIGKILL ``proc``'s whole process group (a run started with ``start_new_session``: kill -9 of it and its
    workers) as soon as ``path`` exists; fails with the run's output if it ends or times out first."""
    deadline = time.monotonic() + timeout_s
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), proc.communicate()[0][-3000:]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@contextmanager
def process_group(cmd: list[str], env: dict[str, str], log: Path, cwd: Path | None = None):
    """Run ``cmd`` in its own session; on exit SIGTERM (then SIGKILL) the whole group."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=cwd or REPO_ROOT,
                                start_new_session=True)
    try:
        yield proc
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def processes_with_env(name: str, value: str) -> list[tuple[int, int]]:
    """``[(pid, ppid)]`` of this user's processes whose environment has ``name=value``."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append((int(entry.name), int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])))
        except (OSError, IndexError, ValueError):
            continue
    return found


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def base_env(**extra: str) -> dict[str, str]:
    """This process's environment (the venv first on PATH) plus ``extra``."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **extra}
    for key in ("PREFECT_API_URL", "RAY_ADDRESS", "MLFLOW_TRACKING_URI"):
        if key not in extra:
            env.pop(key, None)
    return env


@contextmanager
def prefect_server(tmp: Path):
    """``prefect server start`` on a free 127.0.0.1 port with its own home and sqlite database;
    yields ``(api_url, env)`` where ``env`` points Prefect clients at it."""
    port = free_port()
    env = base_env(PREFECT_HOME=str(tmp / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
                   PREFECT_API_URL=f"http://127.0.0.1:{port}/api", PREFECT_WORKER_QUERY_SECONDS="1",
                   PREFECT_LOGGING_LEVEL="WARNING")
    cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    with process_group(cmd, env, tmp / "prefect-server.log") as proc:
        wait_for(lambda: proc.poll() is not None or http_ok(f"http://127.0.0.1:{port}/api/health"), 120,
                 "the Prefect server")
        assert proc.poll() is None, (tmp / "prefect-server.log").read_text()[-2000:]
        yield env["PREFECT_API_URL"], env


S3_SECRET = "moto-secret-" + os.urandom(6).hex()  # the S3 secret key of this test session


@contextmanager
def s3_server():
    """A moto S3 server on a free 127.0.0.1 port, in this process (tests can reach into its state);
    yields ``(boto3 client, env)`` with the AWS_* variables that point s3fs, boto3 and MLflow at it."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {"AWS_ACCESS_KEY_ID": "rollflow-test", "AWS_SECRET_ACCESS_KEY": S3_SECRET, "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": endpoint, "MLFLOW_S3_ENDPOINT_URL": endpoint}
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=S3_SECRET, region_name="us-east-1")
    try:
        yield client, env
    finally:
        server.stop()


@contextmanager
def mlflow_server(tmp: Path, env: dict[str, str]):
    """``infra/mlflow/start.sh`` on a free 127.0.0.1 port (sqlite backend; artifacts where
    ``MLFLOW_ARTIFACTS_DESTINATION`` in ``env`` says); yields its tracking URI."""
    port = free_port()
    env = {"MLFLOW_BACKEND_STORE_URI": f"sqlite:///{tmp}/mlflow-server.db", **env, "MLFLOW_PORT": str(port),
           "MLFLOW_WORKERS": "1"}
    with process_group(["bash", str(REPO_ROOT / "infra" / "mlflow" / "start.sh")], env, tmp / "mlflow-server.log",
                       cwd=tmp) as proc:
        wait_for(lambda: proc.poll() is not None or http_ok(f"http://127.0.0.1:{port}/health"), 120, "the MLflow server")
        assert proc.poll() is None, (tmp / "mlflow-server.log").read_text()[-2000:]
        yield f"http://127.0.0.1:{port}"
