"""``rollflow run`` as a subprocess whose engine is killed once the run reaches a checkpoint (the tests of
``async.mode: full`` replacing a rollout engine that died)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_killing_engine(tmp_path: Path, config: str, overrides: list[str], manifest: Path, role: str = "rollout",
                       timeout_s: float = 600) -> str:
    """Run ``config`` with ``overrides``; once ``manifest`` exists, SIGKILL the engine of ``role`` (from the
    run's ``engines.json``). Returns the run's output; asserts it exited 0."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PYTHONUNBUFFERED": "1"}
    env.pop("PREFECT_API_URL", None)
    run_dir = Path(next(o for o in overrides if o.startswith("run.dir=")).partition("=")[2])
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", config, *overrides], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not manifest.exists():
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, f"no {manifest} in 300 s"
            time.sleep(0.2)
        [engines] = [json.loads(p.read_text()) for p in run_dir.rglob("engines.json")]
        os.kill(engines[role]["pid"], signal.SIGKILL)  # the stream keeps it generating: killed mid-generation
        output = proc.communicate(timeout=timeout_s)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, output[-3000:]
    return output
