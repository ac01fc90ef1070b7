"""A sharded engine's ranks as Ray actors driven as one handle (``engines.rank_group``): every call reaches
every rank in order, rank 0's result comes back, a failing rank fails the call with its own error."""

from __future__ import annotations

import sys

import pytest
import ray
import torch

from engines.actors import run_actor_names
from engines.rank_group import RankGroup, start_rank_group

pytestmark = pytest.mark.ray
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module

KIND = "train/test_rank_group:SummingRank"


class SummingRank:
    """A toy rank: holds ``value``, sums it over the group with an all-reduce."""

    def __init__(self, value: float, rank: int = 0, world_size: int = 1, rendezvous: str | None = None) -> None:
        from engines.training.distributed import init_ranks

        init_ranks(rank, world_size, rendezvous, torch.device("cpu"), timeout_s=60)
        self.rank, self.value, self.calls = rank, value * (rank + 1), []

    def total(self, tag: str) -> tuple[int, float]:
        """``(rank, sum of every rank's value)``: the all-reduce only returns once every rank made this call."""
        self.calls.append(tag)
        tensor = torch.tensor([self.value])
        torch.distributed.all_reduce(tensor)
        return self.rank, float(tensor)

    def history(self) -> list[str]:
        return self.calls

    def fail_on(self, rank: int) -> None:
        if self.rank == rank:
            raise ValueError(f"rank {rank} refuses")
        torch.distributed.barrier()  # the other ranks wait in a collective for the failing one


@pytest.fixture
def group(ray_cluster):
    made = start_rank_group(KIND, run_name="ranks", role="trainer", world_size=2, value=1.0)
    yield made
    for name in run_actor_names("ranks"):
        ray.kill(ray.get_actor(name, namespace="rollflow"))


def test_calls_reach_every_rank_in_order_and_return_rank_0s_result(group):
    # values 1 (rank 0) and 2 (rank 1): the all-reduce sums to 3 on each rank; rank 0 answers
    assert ray.get(group.total.remote("a")) == (0, 3.0)
    assert ray.get(group.total.remote("b")) == (0, 3.0)
    assert [ray.get(rank.history.remote()) for rank in group.ranks] == [["a", "b"], ["a", "b"]]
    assert [name.split("/")[1].split("#")[0] for name in run_actor_names("ranks")] == ["trainer.rank0", "trainer.rank1"]


def test_a_group_built_alike_is_reattached_and_another_replaces_it(group):
    again = start_rank_group(KIND, run_name="ranks", role="trainer", world_size=2, value=1.0)
    assert [r._actor_id for r in again.ranks] == [r._actor_id for r in group.ranks]
    other = start_rank_group(KIND, run_name="ranks", role="trainer", world_size=3, value=1.0)
    assert ray.get(other.total.remote("c")) == (0, 6.0)  # 1 + 2 + 3
    assert len(run_actor_names("ranks")) == 3  # the two ranks of the first group were stopped


def test_a_failing_rank_fails_the_call_with_its_own_error_and_stops_the_group(group):
    with pytest.raises(ray.exceptions.RayTaskError, match="rank 1 refuses"):
        ray.get(group.fail_on.remote(1), timeout=60)
    for rank in group.ranks:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(rank.history.remote(), timeout=30)


def test_a_group_of_one_is_its_actor(ray_cluster):
    single = start_rank_group(KIND, run_name="ranks", role="critic", world_size=1, value=5.0)
    try:
        assert isinstance(single, RankGroup)
        assert ray.get(single.total.remote("x")) == (0, 5.0)
    finally:
        for name in run_actor_names("ranks"):
            ray.kill(ray.get_actor(name, namespace="rollflow"))
