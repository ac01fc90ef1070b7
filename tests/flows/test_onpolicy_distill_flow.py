"""On-policy distillation through the RLVR flow (``stage="onpolicy_distill"``) on real Ray, Prefect and
MLflow: teachers routed by a data column, the teacher's per-token advantage, ``teacher_kl`` metrics."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from configs.loader import load_config

EVEN = [str(n) for n in range(0, 61, 2)]  # answers of the arithmetic rows (sums of operands up to 30)


def perturbed_copy(model_dir: str, out, seed: int, scale: float = 0.5) -> str:
    """``model_dir`` with Gaussian noise on every weight: a teacher with the same tokenizer, another distribution."""
    shutil.copytree(model_dir, out)
    weights = load_file(f"{out}/model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    noisy = {k: v + scale * torch.randn(v.shape, generator=generator, dtype=v.dtype) for k, v in weights.items()}
    save_file(noisy, f"{out}/model.safetensors", metadata={"format": "pt"})
    return str(out)


def metric_history(client, run_id: str, key: str) -> list[float]:
    return [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def test_teacher_scoring_routes_rows_and_groups_metrics():
    from types import SimpleNamespace

    from flows.rlvr import teacher_scoring
    from tasks.score import ScoredBatch

    domains = "[{name: m, reward: math, share: 4, source: arithmetic}, {name: n, reward: math, share: 4, source: arithmetic}]"
    config = load_config("configs/tiny.yaml", ["kind=onpolicy_distill", "data.source=domains", f"data.domains={domains}",
                                               "onpolicy_distill={teachers: [{name: tm, path: x, values: [m]}, "
                                               "{name: tn, path: y}], coef: 0.3, rewards: true}"])
    scored = ScoredBatch(None, None, [0, 0, 1, 1], [""] * 4, {"domain": ["m", "m", "n", "n"]}, {}, {})
    engines = SimpleNamespace(teachers={"tm": "engine-m", "tn": "engine-n"})
    out = teacher_scoring(config, engines, scored)
    assert out["teachers"] == [("engine-m", [0, 1]), ("engine-n", [2, 3])]
    assert out["distill"] == {"teacher_coef": 0.3, "distill_only": False,
                              "teacher_kl_groups": {"m": [0, 1], "n": [2, 3], "tm": [0, 1], "tn": [2, 3]}}
    bad = config.model_copy(update={"onpolicy_distill": config.onpolicy_distill.model_copy(update={"route_key": "lang"})})
    with pytest.raises(ValueError, match="onpolicy_distill.route_key 'lang' is no column of the data; columns: domain"):
        teacher_scoring(bad, engines, scored)


def test_teachers_share_the_reference_placement_slot_only_alone():
    from flows.rlvr import check_teacher_placement

    gpus = load_config("configs/tiny.yaml", ["placement={reference: {gpus: 0.5}}"])
    check_teacher_placement(gpus, 1, reference=False)  # one teacher in the reference's slot
    check_teacher_placement(load_config("configs/tiny.yaml", []), 3, reference=True)  # CPU: no slots to share
    with pytest.raises(ValueError, match="placement.reference.gpus: the reference slot holds one engine, but 1 "
                                         "teacher\\(s\\) and the KL reference would share it"):
        check_teacher_placement(gpus, 1, reference=True)


@pytest.mark.ray
@pytest.mark.slow  # a minute of Ray + Prefect; routing and scoring are covered fast above and in test_onpolicy.py
def test_two_teachers_routed_by_column(tmp_path, tiny_model_dir, ray_cluster, prefect_server):
    from mlflow.tracking import MlflowClient

    from configs.loader import dump_config, flat_params
    from flows.rlvr import rlvr_flow
    from flows.tracking import RunTracker

    teacher = perturbed_copy(tiny_model_dir, tmp_path / "teacher", seed=1)
    run_dir = tmp_path / "run"
    teachers = f"[{{name: even, path: {teacher}, values: [{', '.join(repr(v) for v in EVEN)}]}}, {{name: odd, path: {teacher}}}]"
    config = load_config("configs/tiny.yaml", [
        "kind=onpolicy_distill", f"run.dir={run_dir}", "run.name=opd", "model.source=hf", f"model.path={tiny_model_dir}",
        "train.steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4",
        "eval.every=0", "eval.num_prompts=4", "checkpoint.every=1000", "tracking.sample_every=0",
        "algorithm.policy_loss=importance_sampling", "train.optim.lr=1e-3",
        f"onpolicy_distill={{teachers: {teachers}, route_key: answer, coef: 0.5}}"])
    uri = f"sqlite:///{run_dir}/mlflow.db"
    run_dir.mkdir()
    tracker = RunTracker.create(uri, "opd", "opd", flat_params(config), dump_config(config))
    state = rlvr_flow(config, tiny_model_dir, uri, tracker.run_id, stage="onpolicy_distill")

    assert state["step"] == 2
    client = MlflowClient(tracking_uri=uri)
    kl = metric_history(client, tracker.run_id, "teacher_kl")
    assert len(kl) == 2 and all(math.isfinite(v) for v in kl)
    assert kl[0] > 0.1  # the noisy teacher disagrees with the student on the tokens it samples
    for name in ("even", "odd"):  # the arithmetic answers hold both, so each teacher scores rows every step
        assert all(math.isfinite(v) for v in metric_history(client, tracker.run_id, f"teacher_kl/{name}"))
    # Rewards off: A = -λ k on every completion token, so the token-mean advantage is -λ · teacher_kl.
    advantage = metric_history(client, tracker.run_id, "advantage/mean")
    assert advantage == pytest.approx([-0.5 * v for v in kl], abs=1e-5)
    ratios = metric_history(client, tracker.run_id, "actor/ratio_mean")  # one optimizer step, sampler's log-probs
    assert all(r == pytest.approx(1.0, abs=1e-3) for r in ratios)
    trained = load_file(run_dir / "onpolicy_distill_model" / "model.safetensors")
    base = load_file(f"{tiny_model_dir}/model.safetensors")
    assert any(not torch.equal(trained[k], base[k]) for k in base)


@pytest.mark.ray
@pytest.mark.slow
def test_onpolicy_distillation_halves_teacher_kl_and_reaches_teacher_accuracy(tmp_path, ray_cluster, prefect_server):
    """The preset end to end: a teacher (tiny base + long SFT, held-out accuracy measured by an eval stage)
    and a student (the same base + short SFT) distilled on its own samples."""
    from mlflow.tracking import MlflowClient

    from flows.pipeline import run_flow

    teacher_dir, student_dir = tmp_path / "teacher", tmp_path / "student"
    teacher = run_flow(load_config("configs/distill/onpolicy_tiny.yaml", [
        "kind=pipeline", "pipeline={stages: [sft, eval]}", "sft.steps=400", "model.source=tiny",
        "run.name=opd-teacher", f"run.dir={teacher_dir}", "tracking.register_model=false"]))
    teacher_accuracy = teacher["heldout_accuracy"]["final"]
    student = run_flow(load_config("configs/distill/onpolicy_tiny.yaml", [
        f"model.path={teacher_dir}/base_model", f"onpolicy_distill.teachers=[{{name: teacher, path: {teacher_dir}/sft_model}}]",
        "run.name=opd-student", f"run.dir={student_dir}", "tracking.register_model=false", "tracking.log_model=false"]))
    accuracy = student["heldout_accuracy"]
    before, after = accuracy["0"], accuracy[max(accuracy, key=int)]
    client = MlflowClient(tracking_uri=f"sqlite:///{student_dir}/mlflow.db")
    kl = metric_history(client, student["mlflow_run_id"], "teacher_kl")
    first, last = sum(kl[:10]) / 10, sum(kl[-10:]) / 10  # means over the first and last 10 steps
    print(f"teacher accuracy {teacher_accuracy:.3f}; student {before:.3f} -> {after:.3f}; "
          f"teacher_kl {first:.4f} -> {last:.4f} (steps 1-10 -> last 10)")
    assert last <= 0.5 * first, (first, last)
    assert after >= teacher_accuracy - 0.05, (before, after, teacher_accuracy)
    assert before < teacher_accuracy - 0.05  # the student starts well below the teacher
