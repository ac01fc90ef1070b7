"""kill -9 mid-run, rerun the same command: same MLflow run, one metric value per step, and final weights
bit-identical to a run that was never interrupted (same seed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from configs.loader import load_config
from services import kill_when_written

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # three full runs, two of them subprocesses

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
# The entropy bonus gives the untrained model a gradient every step (it earns no reward yet), so the
# weights, and with them the sampled rollouts, change each step; kl.coef brings in the reference engine.
OVERRIDES = [f"train.steps={STEPS}", "checkpoint.every=2", "checkpoint.keep=1", "eval.every=4", "run.torch_threads=1",
             "run.name=resume", "algorithm.entropy_coef=0.01", "algorithm.kl.coef=0.01"]


def _cli(run_dir: Path, prefect_home: Path, overrides: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PREFECT_HOME": str(prefect_home), "PYTHONUNBUFFERED": "1"}
    env.pop("PREFECT_API_URL", None)
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml", f"run.dir={run_dir}", *overrides],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )


ENGINES = {"hf": ["rollout.engine=hf"], "vllm": ["rollout.engine=vllm"],
           "fsdp2": ["train.engine=fsdp2", "train.ranks=2"],
           "deepspeed-zero3": ["train.engine=deepspeed", "train.ranks=2", "train.deepspeed.stage=3"],
           "lora": ["model.lora.r=8", "train.optim.lr=1e-3"],  # with LoRA the KL reference is the trainer's base
           # rollout one step ahead: the checkpoint holds the batch sampled with weights it no longer has
           "one_step": ["async.mode=one_step", "algorithm.old_logprobs=trainer", "algorithm.correction=tis"]}


@pytest.mark.parametrize("engine", [pytest.param(name, marks=[pytest.mark.vllm] if name == "vllm" else [])
                                    for name in ENGINES])
def test_kill_and_resume_matches_uninterrupted_run(engine, tmp_path, ray_cluster, prefect_server):
    from mlflow.tracking import MlflowClient

    from flows.pipeline import run_flow

    overrides = [*OVERRIDES, *ENGINES[engine]]
    # 1. the run that is never interrupted (in this process, on the shared Ray + Prefect fixtures)
    straight = tmp_path / "straight"
    run_flow(load_config("configs/tiny.yaml", [f"run.dir={straight}", *overrides]))

    # 2. the same command in a subprocess, SIGKILLed (with its whole process group) after a checkpoint
    resumed = tmp_path / "resumed"
    proc = _cli(resumed, tmp_path / "prefect", overrides)
    manifest = resumed / "checkpoints" / "step_000002" / "MANIFEST.json"
    kill_when_written(proc, manifest, timeout_s=300)
    assert not (resumed / "final").exists()
    run_id = (resumed / "run.json").read_text()

    # 3. rerun the same command: resumes from step 2 and finishes
    proc = _cli(resumed, tmp_path / "prefect", overrides)
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, output[-3000:]
    assert (resumed / "run.json").read_text() == run_id  # same MLflow run
    assert "heldout_accuracy start=" in output

    a, b = load_file(straight / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    base = load_file(straight / "base_model" / "model.safetensors")
    trained = [not (a[k] == base[k]).all() for k in a]
    assert any(trained) if engine == "lora" else all(trained), "the run did not train"  # LoRA: adapted layers only
    assert all((a[k] == b[k]).all() for k in a), "resumed weights differ from the uninterrupted run"

    client = MlflowClient(tracking_uri=f"sqlite:///{resumed}/mlflow.db")
    mlflow_run = client.search_runs(client.get_experiment_by_name("rollflow").experiment_id)
    assert len(mlflow_run) == 1 and mlflow_run[0].info.status == "FINISHED"
    straight_client = MlflowClient(tracking_uri=f"sqlite:///{straight}/mlflow.db")
    straight_id = straight_client.search_runs(straight_client.get_experiment_by_name("rollflow").experiment_id)[0].info.run_id
    for key in ("reward/mean", "train/grad_norm", "actor/kl", "eval/heldout_accuracy"):
        history = client.get_metric_history(mlflow_run[0].info.run_id, key)
        steps = sorted(m.step for m in history)
        expected = [0, 4, 8] if key.startswith("eval/") else list(range(1, STEPS + 1))
        assert steps == expected, (key, steps)  # none missing, none twice
        reference = {m.step: m.value for m in straight_client.get_metric_history(straight_id, key)}
        assert {m.step: m.value for m in history} == pytest.approx(reference, rel=1e-6), key

    # 4. a finished run says so and exits 0
    proc = _cli(resumed, tmp_path / "prefect", overrides)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0 and "already finished" in output
