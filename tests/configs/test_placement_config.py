"""The ``placement`` section: what it accepts, and the one-line errors (naming the key) for what Ray could
not reserve or the run cannot use."""

from __future__ import annotations

import pytest

from configs.loader import load_config
from test_presets import _error  # the load error, asserted to be one line

TINY = "configs/tiny.yaml"


def test_no_section_means_cpu_and_one_actor_per_role():
    assert load_config(TINY).placement is None


def test_a_section_fills_every_role_with_the_defaults():
    placement = load_config(TINY, ["placement={rollout: {replicas: 2, gpus: 0.25}, trainer: {gpus: 0.5}, "
                                   "reference: {gpus: 0.25}, colocate: [[trainer, rollout, reference]]}"]).placement
    assert (placement.rollout.replicas, placement.rollout.gpus, placement.trainer.gpus) == (2, 0.25, 0.5)
    assert (placement.critic.replicas, placement.critic.gpus, placement.judge.gpus) == (1, 0.0, 0.0)
    assert placement.colocate == [["trainer", "rollout", "reference"]]


@pytest.mark.parametrize("override, expected", [
    # The trainer is one actor until the sharded trainer exists.
    ("placement.trainer.replicas=2", "placement.trainer.replicas: only rollout runs several replicas, the trainer "
                                     "is one actor; set it to 1"),
    ("placement.reward.replicas=2", "placement.reward.replicas: reward workers are counted by reward.workers; remove it"),
    # Ray hands out fractions of one GPU only.
    ("placement.rollout.gpus=1.5", "placement.rollout.gpus: 1.5 GPUs: above 1 a replica asks whole GPUs (Ray shares out "
                                   "fractions of one GPU only); use a fraction or a whole number"),
    ("placement.rollout.gpus=-1", "placement.rollout.gpus: Input should be greater than or equal to 0 (got -1)"),
    ("placement.colocate=[[trainer, rollut]]", "placement.colocate.0.1: Input should be 'rollout', 'trainer', "
                                               "'reference', 'critic', 'reward' or 'judge' (got 'rollut')"),
    # 0.75 + 0.5 = 1.25 of the one GPU a colocated bundle shares.
    ("placement={trainer: {gpus: 0.75}, rollout: {gpus: 0.5}, colocate: [[trainer, rollout]]}",
     "placement.colocate.0: colocated roles share one GPU per bundle, each asking a share of it, so their gpus must be "
     "above 0 and sum to at most 1 (got trainer 0.75 + rollout 0.5); e.g. 0.5 each"),
    # A colocated role without GPUs would share nothing.
    ("placement={trainer: {gpus: 0.5}, colocate: [[trainer, rollout]]}",
     "placement.colocate.0: colocated roles share one GPU per bundle, each asking a share of it, so their gpus must be "
     "above 0 and sum to at most 1 (got trainer 0.5 + rollout 0); e.g. 0.5 each"),
    ("placement={trainer: {gpus: 0.5}, rollout: {gpus: 0.5}, colocate: [[trainer, rollout], [rollout, reference]]}",
     "placement.colocate.1: colocated group ['rollout', 'reference']: name two or more roles, each in one group only"),
    ("placement={trainer: {gpus: 0.5}, colocate: [[trainer, trainer]]}",
     "placement.colocate.0: colocated group ['trainer', 'trainer']: name two or more roles, each in one group only"),
    ("placement.rollout.cpus=1", "placement.rollout.cpus: unknown key; did you mean 'gpus'?"),
])
def test_placement_errors_name_the_key(override, expected):
    assert _error(TINY, [override]) == f"override {override!r}: {expected}"
