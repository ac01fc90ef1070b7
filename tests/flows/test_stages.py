"""Stages and reruns without Ray: which stages a rerun skips, runs or extends; a config that changes a key
outside ``SAFE_CHANGES`` is refused in one line before any service starts; the config's ``kind``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from configs.loader import ConfigError, load_config
from engines import checkpoint_store as store
from flows.stages import RerunError, Stage, check_rerun, plan, run_record, run_stages, stage_key

ROOT = Path(__file__).resolve().parents[2]


def _config(run_dir, *overrides: str):
    return load_config("configs/tiny.yaml", [f"run.dir={run_dir}", *overrides])


def _record(config) -> None:
    """``run.json`` as a first attempt writes it."""
    store.write_json(store.join(config.run.resolved_dir, "run.json"), run_record(config, mlflow_run_id="first"))


def test_a_changed_key_is_refused_in_one_line_before_anything_starts(tmp_path):
    run_dir = tmp_path / "run"
    _record(_config(run_dir))
    # tiny.yaml: group_size 8, lr 1e-4; eval.every is a safe change and is not listed
    out = subprocess.run([sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml", f"run.dir={run_dir}",
                          "rollout.group_size=4", "train.optim.lr=2e-4", "eval.every=1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == (f"config error: {run_dir} was started with another config: rollout.group_size: "
                                  "8 -> 4, train.optim.lr: 0.0001 -> 0.0002; rerun with its values or use a new run.dir")
    assert sorted(p.name for p in run_dir.iterdir()) == ["run.json"]  # no MLflow store, no model: nothing started


def test_safe_changes_are_accepted_and_listed(tmp_path):
    _record(_config(tmp_path))
    changed = _config(tmp_path, "train.steps=6", "eval.every=3", "checkpoint.keep=1", "reward.workers=2",
                      "run.torch_threads=1", "tracking.sample_every=0")
    assert check_rerun(changed) == ["run.torch_threads: 0 -> 1", "reward.workers: 1 -> 2", "train.steps: 4 -> 6",
                                    "eval.every: 2 -> 3", "checkpoint.keep: 2 -> 1", "tracking.sample_every: 2 -> 0"]
    assert check_rerun(_config(tmp_path)) == []


@pytest.mark.parametrize("overrides, refused", [
    (["train.steps=3"], "train.steps: 4 -> 3 (train.steps can only be raised)"),
    # a cosine schedule is stretched over train.steps: the LR of steps 1-4 would change
    (["train.optim.schedule=cosine", "train.steps=6"], "train.steps: 4 -> 6 (train.optim.schedule: cosine spans "
     "train.steps, so more steps would change the steps already taken), train.optim.schedule: constant -> cosine"),
    (["sft.steps=3"], 'sft: null -> {"data":{"source":"rl","train_path":nul…'),  # a section set on one side only
])
def test_unsafe_changes_name_every_refused_key(tmp_path, overrides, refused):
    _record(_config(tmp_path))
    with pytest.raises(RerunError) as error:
        check_rerun(_config(tmp_path, *overrides))
    assert str(error.value) == f"{tmp_path} was started with another config: {refused}; rerun with its values or use a new run.dir"


def test_a_run_directory_without_a_recorded_config_is_not_compared(tmp_path):
    assert check_rerun(_config(tmp_path / "new")) == []
    store.write_json(store.join(str(tmp_path), "run.json"), {"mlflow_run_id": "from-before-configs-were-recorded"})
    assert check_rerun(_config(tmp_path, "rollout.group_size=4")) == []


def _stages(run_dir, calls: list, steps: int = 3) -> list[Stage]:
    """base → sft → rl stand-ins: each records its call and writes its marker with its key."""
    def make(name: str, step: int):
        def run(config, input_uri, tracker):
            out = store.join(str(run_dir), name)
            calls.append((name, input_uri, store.read_json(store.join(out, store.MANIFEST))))
            store.write_json(store.join(out, "weights.json"), {"from": input_uri})
            store.write_manifest(out, step, ["weights.json"], key=stage_key(config, name, input_uri))
            return out
        return run
    return [Stage("base_model", store.join(str(run_dir), "base_model"), make("base_model", 0)),
            Stage("sft", store.join(str(run_dir), "sft"), make("sft", 5)),
            Stage("rlvr", store.join(str(run_dir), "rlvr"), make("rlvr", steps), steps=steps)]


def test_stages_run_once_in_order_each_on_the_previous_output(tmp_path):
    config, calls = _config(tmp_path, "sft.steps=5"), []
    assert run_stages(config, _stages(tmp_path, calls), tracker=None) == f"{tmp_path}/rlvr"
    assert calls == [("base_model", None, None), ("sft", f"{tmp_path}/base_model", None),
                     ("rlvr", f"{tmp_path}/sft", None)]
    assert [action for _, action in plan(config, _stages(tmp_path, calls))] == ["skip", "skip", "skip"]
    run_stages(config, _stages(tmp_path, calls), tracker=None)
    assert len(calls) == 3  # all done: nothing ran again


def test_more_steps_extend_the_last_stage_from_its_own_output(tmp_path):
    config, calls = _config(tmp_path, "sft.steps=5"), []
    run_stages(config, _stages(tmp_path, calls, steps=3), tracker=None)
    more = _stages(tmp_path, calls, steps=4)
    assert [action for _, action in plan(config, more)] == ["skip", "skip", "extend"]
    run_stages(config, more, tracker=None)
    # the RL stage ran again on the same input, its old marker removed first (never half-new and "done")
    assert calls[3] == ("rlvr", f"{tmp_path}/sft", None)
    assert store.read_json(f"{tmp_path}/rlvr/MANIFEST.json")["step"] == 4
    with pytest.raises(RerunError, match=r"stage rlvr: .*/rlvr holds 4 steps, more than the 3 asked for"):
        plan(config, _stages(tmp_path, calls, steps=3))


def test_a_marker_made_from_other_inputs_is_an_error_naming_the_stage(tmp_path):
    calls = []
    run_stages(_config(tmp_path, "sft.steps=5"), _stages(tmp_path, calls), tracker=None)
    # other data under the same run directory: every stage's key changes, the first one found is named
    with pytest.raises(RerunError, match=r"^stage base_model: .*/base_model was made from other inputs"):
        plan(_config(tmp_path, "sft.steps=5", "data.arithmetic.num_train=400"), _stages(tmp_path, calls))
    # only the SFT settings differ: base model still done, SFT refused
    with pytest.raises(RerunError, match=r"^stage sft: "):
        plan(_config(tmp_path, "sft.steps=5", "sft.batch_size=8"), _stages(tmp_path, calls))


def test_safe_changes_keep_every_stage_key(tmp_path):
    config = _config(tmp_path, "sft.steps=5")
    safe = _config(tmp_path, "sft.steps=5", "eval.every=3", "checkpoint.every=1", "reward.concurrency=2",
                   "tracking.num_samples=2", "train.steps=9")
    unsafe = _config(tmp_path, "sft.steps=5", "rollout.temperature=0.5")
    for name in ("base_model", "sft", "rlvr"):
        assert stage_key(safe, name, "in") == stage_key(config, name, "in"), name
    assert stage_key(unsafe, "rlvr", "in") != stage_key(config, "rlvr", "in")
    assert stage_key(unsafe, "sft", "in") == stage_key(config, "sft", "in")  # SFT does not read rollout
    assert stage_key(config, "rlvr", "other-input") != stage_key(config, "rlvr", "in")


def test_the_kind_picks_the_stages_and_an_unknown_kind_lists_the_known_ones(tmp_path):
    assert _config(tmp_path).kind == "rlvr"
    known = "rlvr, sft, dpo, distill, onpolicy_distill, agentic, pipeline"
    with pytest.raises(ConfigError) as error:
        load_config("configs/tiny.yaml", ["kind=ppo"])
    assert str(error.value) == f"override 'kind=ppo': kind: unknown pipeline kind 'ppo'; known: {known}"
    preset = tmp_path / "dpo.yaml"
    preset.write_text("kind: dpo\n")  # a dpo run without its section says which one to add
    with pytest.raises(ConfigError, match=r"^.*dpo.yaml: dpo: stage dpo needs a dpo: section"):
        load_config(preset)
    assert load_config(preset, ["dpo.steps=3"]).stage_names() == ["dpo"]
    assert load_config(preset, ["dpo.steps=3", "sft.steps=2"]).stage_names() == ["sft", "dpo"]  # a warm start


def test_a_pipeline_reruns_a_changed_stage_and_the_ones_after_it(tmp_path):
    def pipeline(*overrides):
        return _config(tmp_path, "kind=pipeline", "pipeline.stages=[sft, rlvr]", "sft.steps=5", *overrides)

    calls = []
    run_stages(pipeline(), _stages(tmp_path, calls), tracker=None)
    _record(pipeline())
    changed = pipeline("sft.batch_size=8")
    assert check_rerun(changed) == ["sft.batch_size: 32 -> 8"]  # a pipeline accepts any change ...
    # ... and its plan replaces the changed stage and the one after it (its input changed)
    assert [action for _, action in plan(changed, _stages(tmp_path, calls))] == ["skip", "replace", "replace"]
    run_stages(changed, _stages(tmp_path, calls), tracker=None)
    assert [name for name, *_ in calls[3:]] == ["sft", "rlvr"]
    assert calls[3][2] is None  # the old marker was removed before the stage ran again
    assert [action for _, action in plan(changed, _stages(tmp_path, calls))] == ["skip", "skip", "skip"]
    # a change of the RL stage's config leaves SFT done
    assert [action for _, action in plan(pipeline("sft.batch_size=8", "rollout.temperature=0.5"),
                                         _stages(tmp_path, calls))] == ["skip", "skip", "replace"]


def test_checkpoints_of_another_stage_key_are_deleted_before_the_stage_resumes(tmp_path):
    from flows.stages import claim_checkpoints

    root = str(tmp_path / "stage")
    store.write_json(store.join(store.step_dir(root, 2), "state.json"), {"step": 2})
    store.write_manifest(store.step_dir(root, 2), 2, ["state.json"])
    claim_checkpoints(root, "key-a")  # the first claim keeps what is there (a run from before keys)
    assert store.latest_checkpoint(root)[0] == 2
    claim_checkpoints(root, "key-a")
    assert store.latest_checkpoint(root)[0] == 2
    claim_checkpoints(root, "key-b")  # made with other inputs: gone, the stage starts over
    assert store.latest_checkpoint(root) is None
    assert store.read_json(store.join(root, "checkpoints", "stage_key.json")) == {"key": "key-b"}


def test_an_agentic_stage_key_follows_its_environment_not_the_rl_rows(tmp_path):
    base = [f"run.dir={tmp_path}"]
    config = load_config("configs/agentic/corridor.yaml", base)
    assert config.stage_names() == ["sft", "agentic"]
    key = stage_key(config, "agentic", "in")
    assert stage_key(load_config("configs/agentic/corridor.yaml", [*base, "data.arithmetic.num_train=10"]),
                     "agentic", "in") == key  # no RL rows in an agentic stage
    for change in ("agentic.max_turns=3", "agentic.env_options={length: 5}", "agentic.mode=step", "rollout.group_size=4"):
        assert stage_key(load_config("configs/agentic/corridor.yaml", [*base, change]), "agentic", "in") != key, change
    with pytest.raises(ConfigError, match="sft.data.source 'env' plays random moves in the agentic: environment"):
        load_config("configs/agentic/corridor.yaml", [*base, "kind=sft", "agentic=null"])
    with pytest.raises(ConfigError, match=r"algorithm.old_logprobs.*async batches turns.*old_logprobs=trainer"):
        load_config("configs/agentic/corridor.yaml", [*base, "algorithm.old_logprobs=rollout"])
    load_config("configs/agentic/corridor.yaml", [*base, "algorithm.old_logprobs=rollout", "agentic.runner=lockstep"])
