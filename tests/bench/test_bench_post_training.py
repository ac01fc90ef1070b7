"""``bench/post_training.py`` compares like with like: on the same batches RollFlow's engine and TRL's
SFTTrainer / DPOTrainer compute the same losses, step after step. Skipped without TRL (the ``bench`` extra)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ is not an installed package

from bench import post_training, trl_post_training  # noqa: E402

SHAPE = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
STEPS, ROWS, PAIRS = 2, 8, 4


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("post-training")
    model, rows, pairs = post_training.build(str(out), steps=STEPS, sft_rows=ROWS, pairs=PAIRS, shape=SHAPE)
    post_training.write_rows(out / "rows.json", model, rows, pairs)
    return model, rows, pairs, out / "rows.json"


def _trl(model: str, rows_file: Path, task: str, batch: int, *flags: str) -> dict:
    return trl_post_training.main([model, str(rows_file), f"--task={task}", f"--steps={STEPS}", f"--batch={batch}",
                                   f"--lr={post_training.LR}", *flags])


def test_sft_losses_equal_trl_on_the_same_batches(rows_file):
    model, rows, _, path = rows_file
    ours = post_training.rollflow_sft(model, rows, ROWS)
    theirs = _trl(model, path, "sft", ROWS)
    assert theirs["tokens"] == ours["tokens"]  # TRL's steps saw our batches, padding-free
    # step 1: the same weights and tokens, token-mean NLL over the answer tokens on both sides; step 2 follows
    # one AdamW step at the same LR and clip on each side
    assert ours["losses"] == pytest.approx(theirs["losses"], abs=1e-4)


@pytest.mark.parametrize("precompute_ref", [1, 0])
def test_dpo_losses_equal_trl_and_start_at_ln2(rows_file, precompute_ref):
    model, _, pairs, path = rows_file
    ours = post_training.rollflow_dpo(model, pairs, PAIRS)
    theirs = _trl(model, path, "dpo", PAIRS, f"--precompute-ref={precompute_ref}")
    assert theirs["tokens"] == ours["tokens"]
    # at init the policy is the reference: every margin is 0 and -log σ(0) = ln 2 on both sides
    assert ours["losses"][0] == pytest.approx(math.log(2), abs=1e-5)
    assert theirs["losses"][0] == pytest.approx(math.log(2), abs=1e-5)
    assert ours["losses"][1] == pytest.approx(theirs["losses"][1], abs=1e-4)
    assert ours["losses"][1] != pytest.approx(math.log(2), abs=1e-4)  # step 2 moved off ln 2: the check has teeth
