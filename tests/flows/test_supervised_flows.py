"""The supervised stages end to end on tiny models (Ray, Prefect, MLflow): SFT's metrics and exact resume,
DPO at initialisation and its reference cache, offline distillation's teacher cache."""

from __future__ import annotations

import json
import math

import pytest
from safetensors.torch import load_file

from configs.loader import load_config

pytestmark = pytest.mark.ray

SMALL = ["model.tiny.num_layers=2", "model.tiny.hidden_size=64", "model.tiny.intermediate_size=128",
         "model.tiny.vocab_size=96", "tracking.log_model=false", "tracking.register_model=false"]


def _metrics(run_dir, run_id: str, name: str) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    history = client.get_metric_history(run_id, name)
    steps = [m.step for m in history]
    assert len(steps) == len(set(steps)), f"{name} logged twice at a step: {steps}"
    return {m.step: m.value for m in history}


def _sft_config(run_dir, *overrides: str):
    return load_config("configs/sft/tiny_chat.yaml", [
        f"run.dir={run_dir}", "run.name=sft-flow", *SMALL, "sft.data.num_train=64", "sft.data.num_heldout=16",
        "sft.steps=4", "sft.batch_size=8", "sft.micro_batch_size=4", "sft.eval_every=2", "sft.checkpoint_every=2",
        *overrides])


def test_sft_logs_accuracy_and_a_killed_stage_resumes_to_the_same_weights(tmp_path, ray_cluster, prefect_server,
                                                                         monkeypatch):
    import flows.supervised as supervised
    from flows.pipeline import run_flow

    whole = run_flow(_sft_config(tmp_path / "whole"))
    expected = load_file(tmp_path / "whole" / "sft_model" / "model.safetensors")
    accuracy = _metrics(tmp_path / "whole", whole["mlflow_run_id"], "sft/token_accuracy")
    heldout = _metrics(tmp_path / "whole", whole["mlflow_run_id"], "sft/eval/token_accuracy")
    assert sorted(accuracy) == [1, 2, 3, 4] and all(0 <= v <= 1 for v in accuracy.values())
    assert sorted(heldout) == [0, 2, 4]  # the start, then every eval_every
    assert whole["heldout"]["sft/eval/loss"] > 0

    calls = {"n": 0}
    original = supervised.supervised_train

    def dies_at_step_3(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("killed at step 3")
        return original(*args, **kwargs)

    monkeypatch.setattr(supervised, "supervised_train", dies_at_step_3)
    with pytest.raises(RuntimeError, match="killed at step 3"):
        run_flow(_sft_config(tmp_path / "killed"))
    assert (tmp_path / "killed" / "stages" / "sft" / "checkpoints" / "step_000002" / "MANIFEST.json").exists()
    monkeypatch.setattr(supervised, "supervised_train", original)
    resumed = run_flow(_sft_config(tmp_path / "killed"))

    weights = load_file(tmp_path / "killed" / "sft_model" / "model.safetensors")
    assert weights.keys() == expected.keys()
    assert all((weights[name] == expected[name]).all() for name in expected)  # bit-exact
    # steps 1-2 from the first attempt, 3-4 from the resumed one, each once, in one MLflow run
    assert sorted(_metrics(tmp_path / "killed", resumed["mlflow_run_id"], "sft/loss")) == [1, 2, 3, 4]


def test_dpo_starts_at_ln2_with_zero_rewards_and_caches_the_reference(tmp_path, ray_cluster, prefect_server):
    from flows.pipeline import run_flow
    from flows.supervised import cache_manifest

    run_dir = tmp_path / "dpo"
    config = load_config("configs/dpo/tiny.yaml", [
        f"run.dir={run_dir}", "run.name=dpo-flow", *SMALL, "sft=null", "dpo.data.num_train=32",
        "dpo.data.num_heldout=8", "dpo.steps=2", "dpo.batch_size=8", "dpo.micro_batch_size=4"])
    result = run_flow(config)

    # step 1's metrics are those of the weights before its update: the policy is the reference, so every
    # log-ratio is 0: rewards β·0 = 0 and loss −log σ(0) = ln 2
    loss = _metrics(run_dir, result["mlflow_run_id"], "dpo/loss")
    assert loss[1] == pytest.approx(math.log(2), abs=1e-5)
    for name in ("dpo/rewards/chosen", "dpo/rewards/rejected", "dpo/rewards/margins"):
        assert abs(_metrics(run_dir, result["mlflow_run_id"], name)[1]) < 1e-5, name
    assert loss[2] != pytest.approx(math.log(2), abs=1e-7)  # the first step moved the policy

    caches = sorted((run_dir / "cache").iterdir())
    assert [c.name.split("-")[1] for c in caches] == ["heldout", "train"]
    manifest = json.loads((caches[1] / "manifest.json").read_text())
    assert manifest["rows"] == 32 and manifest["scorer"] == str(run_dir / "base_model")
    # the key follows the reference, the data and the tokenization, not the loss settings
    digests = {"model": "m", "scorer": "s"}
    key = lambda cfg: cache_manifest(cfg, "dpo", digests, str(run_dir / "base_model"), "x")["key"]  # noqa: E731
    assert key(config) == key(config.model_copy(update={"dpo": config.dpo.model_copy(update={"beta": 0.5})}))
    longer = config.dpo.model_copy(update={"data": config.dpo.data.model_copy(update={"max_length": 65})})
    assert key(config) != key(config.model_copy(update={"dpo": longer}))


@pytest.mark.slow  # the teacher cache path; the divergences and the objective are covered fast elsewhere
def test_offline_distillation_from_an_identical_teacher_starts_at_zero(tmp_path, ray_cluster, prefect_server):
    from flows.pipeline import run_flow

    run_dir = tmp_path / "distill"
    config = load_config("configs/distill/offline_tiny.yaml", [
        f"run.dir={run_dir}", "run.name=distill-flow", *SMALL, "model.source=tiny", "model.path=null",
        f"distill.teacher.path={run_dir / 'base_model'}", "distill.teacher.top_k=4", "distill.data.num_train=32",
        "distill.data.num_heldout=8", "distill.steps=2", "distill.batch_size=8", "distill.micro_batch_size=8"])
    result = run_flow(config)

    # the teacher is the student's own start: forward KL over the top-4 + tail buckets is 0 before step 1
    divergence = _metrics(run_dir, result["mlflow_run_id"], "distill/loss")
    assert abs(divergence[1]) < 1e-5 and divergence[2] > divergence[1]
    assert _metrics(run_dir, result["mlflow_run_id"], "distill/top1_agreement")[1] == pytest.approx(1.0)
    [train_cache] = [c for c in (run_dir / "cache").iterdir() if c.name.startswith("distill-train")]
    manifest = json.loads((train_cache / "manifest.json").read_text())
    assert (manifest["top_k"], manifest["temperature"], manifest["scorer"]) == (4, 1.0, str(run_dir / "base_model"))
