"""A stage pipeline (SFT → RLVR → distill → eval) killed with SIGKILL inside the distill stage: the rerun
skips SFT and RLVR, resumes distill from its checkpoint and ends with the weights of an uninterrupted
pipeline; each stage is one MLflow run nested under the pipeline's; a changed stage reruns with those after it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from configs.loader import load_config
from services import kill_when_written

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # four pipelines, two of them subprocesses

ROOT = Path(__file__).resolve().parents[2]


def _overrides(run_dir: Path, *extra: str) -> list[str]:
    return [f"run.dir={run_dir}", "run.name=pipeline", "run.torch_threads=1", "sft.steps=4", "sft.batch_size=8",
            "train.steps=2", "checkpoint.every=1", "eval.every=0", "eval.num_prompts=8", "tracking.sample_every=0",
            f"distill.teacher.path={run_dir / 'sft_model'}", "distill.steps=6", "distill.batch_size=8",
            "distill.checkpoint_every=2", "distill.optim.lr=1e-3", "tracking.log_model=false", *extra]


def _cli(run_dir: Path, prefect_home: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PREFECT_HOME": str(prefect_home), "PYTHONUNBUFFERED": "1"}
    env.pop("PREFECT_API_URL", None)
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "configs/pipelines/tiny.yaml",
                             *_overrides(run_dir, *extra)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _stage_runs(run_dir: Path) -> dict[str, list]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    runs = client.search_runs(client.get_experiment_by_name("rollflow").experiment_id)
    [parent] = [r for r in runs if "rollflow.stage" not in r.data.tags]
    by_stage: dict[str, list] = {}
    for run in runs:
        if "rollflow.stage" in run.data.tags:
            assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
            by_stage.setdefault(run.data.tags["rollflow.stage"], []).append(run)
    return by_stage


def test_killed_pipeline_resumes_its_distill_stage_to_the_uninterrupted_weights(tmp_path, ray_cluster, prefect_server):
    from flows.pipeline import run_flow

    straight = tmp_path / "straight"
    run_flow(load_config("configs/pipelines/tiny.yaml", _overrides(straight)))

    killed = tmp_path / "killed"
    proc = _cli(killed, tmp_path / "prefect")
    manifest = killed / "stages" / "distill" / "checkpoints" / "step_000002" / "MANIFEST.json"
    kill_when_written(proc, manifest, timeout_s=600)
    assert not (killed / "distill_model" / "MANIFEST.json").exists()

    proc = _cli(killed, tmp_path / "prefect")
    output = proc.communicate(timeout=900)[0]
    assert proc.returncode == 0, output[-3000:]
    for done in ("base_model", "sft", "rlvr"):
        assert f"stage {done}: done, skipped" in output, output[-3000:]
    assert "stage distill: runs" in output and "distill 3/6" in output and "distill 1/6" not in output

    a = load_file(straight / "distill_model" / "model.safetensors")
    b = load_file(killed / "distill_model" / "model.safetensors")
    rl = load_file(straight / "final" / "model.safetensors")
    assert not all((a[k] == rl[k]).all() for k in a), "the distill stage did not train"
    assert all((a[k] == b[k]).all() for k in a), "resumed weights differ from the uninterrupted pipeline"
    runs = _stage_runs(killed)
    assert {stage: len(found) for stage, found in runs.items()} == {"base_model": 1, "sft": 1, "rlvr": 1,
                                                                     "distill": 1, "eval": 1}
    assert all(found[0].info.status == "FINISHED" for found in runs.values())

    # a changed distill stage runs again, with the eval after it; SFT and RLVR stay done
    proc = _cli(killed, tmp_path / "prefect", "distill.steps=4")
    output = proc.communicate(timeout=900)[0]
    assert proc.returncode == 0, output[-3000:]
    assert "stage rlvr: done, skipped" in output and "stage distill: changed since it ran: runs again" in output
    assert "stage eval: changed since it ran" in output  # its input model changed
    runs = _stage_runs(killed)
    assert (len(runs["sft"]), len(runs["rlvr"]), len(runs["distill"]), len(runs["eval"])) == (1, 1, 2, 2)
