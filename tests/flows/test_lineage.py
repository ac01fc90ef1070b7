"""Lineage tags of a registered model: what each one is computed from, and when it changes."""

from __future__ import annotations

import json
import re

from configs.loader import load_config
from flows.lineage import config_hash, dataset_fingerprint, git_commit, lineage_tags, parent_run_id


def test_config_hash_follows_the_resolved_config():
    base = load_config("tiny")
    assert config_hash(base) == config_hash(load_config("tiny", ["run.seed=0"]))  # the default, spelled out
    assert config_hash(base) != config_hash(load_config("tiny", ["train.optim.lr=2e-4"]))
    assert re.fullmatch(r"[0-9a-f]{64}", config_hash(base))


def test_dataset_fingerprint_sees_every_row_and_the_split_boundary():
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "2+2=", "answer": "4"}]
    same = dataset_fingerprint(rows, [rows[0]])
    assert same == dataset_fingerprint([dict(reversed(list(r.items()))) for r in rows], [rows[0]])  # key order
    assert same != dataset_fingerprint(rows, [{"prompt": "1+2=", "answer": "4"}])  # one answer changed
    assert same != dataset_fingerprint(rows + [rows[0]], [])  # same rows, other split


def test_parent_run_is_the_run_that_wrote_the_starting_model(tmp_path):
    final = tmp_path / "earlier_run" / "final"
    final.mkdir(parents=True)
    (final / "state.json").write_text(json.dumps({"mlflow_run_id": "abc123", "step": 20}))
    chained = load_config("tiny", ["model.source=hf", f"model.path={final}"])
    assert parent_run_id(chained) == "abc123"
    assert lineage_tags(chained, [], [])["rollflow.parent_run_id"] == "abc123"
    explicit = load_config("tiny", ["model.source=hf", f"model.path={final}", "tracking.parent_run_id=fed456"])
    assert parent_run_id(explicit) == "fed456"
    assert parent_run_id(load_config("tiny", ["model.source=hf", "model.path=Qwen/Qwen2.5-0.5B"])) is None  # hub id
    assert "rollflow.parent_run_id" not in lineage_tags(load_config("tiny"), [], [])


def test_git_commit_names_this_checkout(monkeypatch):
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", git_commit())
    monkeypatch.setenv("ROLLFLOW_GIT_COMMIT", "0123abc")  # images without .git say it in the environment
    assert git_commit() == "0123abc"
