"""kill -9 an agentic run mid-way, rerun the same command: it resumes from its checkpoint and ends with the
weights of a run that was never interrupted (episode seeds are a pure function of run seed, step, group)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from configs.loader import load_config
from services import kill_when_written

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # three runs, two of them subprocesses

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/agentic/corridor.yaml"
OVERRIDES = ["train.steps=6", "checkpoint.every=2", "checkpoint.keep=1", "eval.every=3", "run.torch_threads=1",
             "run.name=agentic-resume", "sft.steps=4", "sft.batch_size=8", "agentic.warm_start_episodes=32",
             "rollout.prompts_per_step=4", "rollout.group_size=4", "agentic.eval_seeds=8", "agentic.mode=step",
             "algorithm.entropy_coef=0.01"]


def _cli(run_dir: Path, prefect_home: Path) -> subprocess.Popen:
    env = {**os.environ, "PREFECT_HOME": str(prefect_home), "PYTHONUNBUFFERED": "1"}
    env.pop("PREFECT_API_URL", None)
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "run", CONFIG, f"run.dir={run_dir}", *OVERRIDES],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def test_killed_agentic_run_resumes_to_the_uninterrupted_weights(tmp_path, ray_cluster, prefect_server):
    from flows.pipeline import run_flow

    straight = tmp_path / "straight"
    run_flow(load_config(CONFIG, [f"run.dir={straight}", *OVERRIDES]))

    resumed = tmp_path / "resumed"
    proc = _cli(resumed, tmp_path / "prefect")
    manifest = resumed / "stages" / "agentic" / "checkpoints" / "step_000002" / "MANIFEST.json"
    kill_when_written(proc, manifest, timeout_s=400)
    assert not (resumed / "agentic_model" / "MANIFEST.json").exists()

    proc = _cli(resumed, tmp_path / "prefect")
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, output[-3000:]
    assert "stage sft: done, skipped" in output  # the warm start is not redone

    a = load_file(straight / "agentic_model" / "model.safetensors")
    b = load_file(resumed / "agentic_model" / "model.safetensors")
    start = load_file(straight / "sft_model" / "model.safetensors")
    assert all(not (a[k] == start[k]).all() for k in a), "the run did not train every weight"
    assert all((a[k] == b[k]).all() for k in a), "resumed weights differ from the uninterrupted run"
