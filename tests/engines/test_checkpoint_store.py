"""A checkpoint counts only once its manifest is written; pruning keeps the newest complete ones."""

from __future__ import annotations

import pytest

from engines import checkpoint_store as store
from engines.data.sampler import take


def _make(run_dir: str, step: int, complete: bool = True) -> str:
    uri = store.step_dir(run_dir, step)
    store.write_json(store.join(uri, "state.json"), {"step": step})
    if complete:
        store.write_manifest(uri, step, ["state.json"])
    return uri


def test_latest_ignores_checkpoints_without_manifest(tmp_path):
    run = str(tmp_path)
    assert store.latest_checkpoint(run) is None
    _make(run, 2)
    _make(run, 4, complete=False)  # a crash between state.json and the manifest
    assert store.latest_checkpoint(run) == (2, store.step_dir(run, 2))


def test_manifest_refuses_missing_files(tmp_path):
    uri = store.step_dir(str(tmp_path), 1)
    with pytest.raises(FileNotFoundError, match="lacks"):
        store.write_manifest(uri, 1, ["policy/model.safetensors"])
    assert store.latest_checkpoint(str(tmp_path)) is None


def test_prune_keeps_newest(tmp_path):
    run = str(tmp_path)
    for step in (2, 4, 6):
        _make(run, step)
    assert store.prune(run, keep=2) == [store.step_dir(run, 2)]
    assert [s for s, _ in store.complete_checkpoints(run)] == [4, 6]


def test_json_round_trip_and_no_temp_files_left(tmp_path):
    uri = str(tmp_path / "a" / "b.json")
    store.write_json(uri, {"x": 1})
    assert store.read_json(uri) == {"x": 1}
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["b.json"]


def test_sampler_is_a_function_of_position():
    # 5 rows, batches of 3: positions 0..2 from epoch 0, 3..5 cross into epoch 1
    first, pos = take(5, 0, 3, seed=1)
    second, pos = take(5, pos, 3, seed=1)
    again, _ = take(5, 3, 3, seed=1)  # resuming at position 3 draws the same batch
    assert pos == 6 and second == again
    epoch0 = first + second[:2]
    assert sorted(epoch0) == [0, 1, 2, 3, 4]  # each row once per epoch
