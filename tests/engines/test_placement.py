"""Placement: the pure plan (bundles and each actor's slot), then what a local Ray with four declared GPUs
(``ray_cluster``; none are real) reserves for it and where actors land."""

from __future__ import annotations

import pytest
from services import wait_for

from engines.placement import NO_SLOT, RoleSpec, Slot, plan_placement


# -- the plan ------------------------------------------------------------------------------------------

def test_disaggregated_roles_get_a_bundle_per_replica_and_cpu_roles_none():
    plan = plan_placement({"rollout": RoleSpec(replicas=2, gpus=1), "trainer": RoleSpec(gpus=2),
                           "reward": RoleSpec(replicas=3)})
    # Dict order: rollout's group first (a bundle per replica), then the trainer's two-GPU bundle.
    assert plan.groups == ((1, 1), (2,))
    assert plan.slots == {("rollout", 0): Slot(0, 0, 1), ("rollout", 1): Slot(0, 1, 1), ("trainer", 0): Slot(1, 0, 2),
                          ("reward", 0): NO_SLOT, ("reward", 1): NO_SLOT, ("reward", 2): NO_SLOT}
    assert plan.gpus == 4


def test_colocated_roles_share_bundle_i_with_replica_i():
    plan = plan_placement({"rollout": RoleSpec(replicas=2, gpus=0.25), "trainer": RoleSpec(gpus=0.5),
                           "reference": RoleSpec(gpus=0.25), "critic": RoleSpec(gpus=1)},
                          colocate=[["trainer", "rollout", "reference"]])
    # Bundle 0: trainer 0.5 + rollout-0 0.25 + reference 0.25 = 1 GPU; bundle 1: rollout-1 alone, 0.25.
    # The critic is not colocated: a group of its own, after the colocated one.
    assert plan.groups == ((1.0, 0.25), (1,))
    assert plan.slots[("trainer", 0)] == Slot(0, 0, 0.5)
    assert plan.slots[("rollout", 0)] == Slot(0, 0, 0.25)
    assert plan.slots[("reference", 0)] == Slot(0, 0, 0.25)
    assert plan.slots[("rollout", 1)] == Slot(0, 1, 0.25)
    assert plan.slots[("critic", 0)] == Slot(1, 0, 1)


def test_fractional_sums_are_rounded_to_rays_precision():
    plan = plan_placement({"trainer": RoleSpec(gpus=0.1), "rollout": RoleSpec(gpus=0.2)}, [["trainer", "rollout"]])
    assert plan.groups == ((0.3,),)  # 0.1 + 0.2 is 0.30000000000000004 in floats; Ray counts in 1e-4 units


def test_colocated_roles_the_run_does_not_start_are_left_out():
    plan = plan_placement({"trainer": RoleSpec(gpus=0.5), "rollout": RoleSpec(gpus=0.5)},
                          [["trainer", "rollout", "reference"], ["critic", "judge"]])
    assert plan.groups == ((1.0,),)
    assert set(plan.slots) == {("trainer", 0), ("rollout", 0)}


def test_no_gpus_plans_no_groups():
    plan = plan_placement({"rollout": RoleSpec(replicas=2), "trainer": RoleSpec()})
    assert plan.groups == () and plan.gpus == 0
    assert set(plan.slots.values()) == {NO_SLOT}


# -- on Ray --------------------------------------------------------------------------------------------

def _where(handle):
    """Inside the actor: its GPU ids, its placement group's id (hex, None outside one), CUDA availability."""
    import ray

    def probe(_self):
        import torch

        return ray.get_gpu_ids(), ray.get_runtime_context().get_placement_group_id(), torch.cuda.is_available()

    return ray.get(handle.__ray_call__.remote(probe))


def _bundle_use(group_id: str, bundle: int) -> tuple[float, int]:
    """GPUs left in a bundle and actors placed in it, from Ray's per-bundle resources: a bundle's
    ``GPU_group_<i>_<id>`` is what its actors have not taken, and each actor takes 0.001 of its 1000
    ``bundle_group_<i>_<id>`` units."""
    import ray

    free = ray.available_resources()
    return free.get(f"GPU_group_{bundle}_{group_id}", 0.0), round((1000 - free[f"bundle_group_{bundle}_{group_id}"]) * 1000)


@pytest.mark.ray
def test_reserve_places_colocated_actors_on_one_gpu_and_others_apart(ray_cluster):
    import ray

    from engines.placement import reserve, run_group_names

    @ray.remote(num_cpus=0)  # as start_engine asks: bundles hold GPUs only
    class Probe:
        pass

    plan = plan_placement({"rollout": RoleSpec(replicas=2, gpus=0.25), "trainer": RoleSpec(gpus=0.5),
                           "reference": RoleSpec(gpus=1)}, [["trainer", "rollout"]])
    assert plan.groups == ((0.75, 0.25), (1,))
    reservation = reserve(plan, "place-test", timeout_s=30)
    try:
        table = ray.util.placement_group_table()
        assert [table[g.id.hex()]["bundles"] for g in reservation.groups] == [{0: {"GPU": 0.75}, 1: {"GPU": 0.25}},
                                                                              {0: {"GPU": 1.0}}]
        assert [table[g.id.hex()]["strategy"] for g in reservation.groups] == ["PACK", "PACK"]
        assert ray.available_resources()["GPU"] == 4 - 2  # 0.75 + 0.25 + 1 reserved of the 4 declared
        assert len(run_group_names("place-test")) == 2

        actors = {key: Probe.options(**reservation.options(*key)).remote()
                  for key in [("trainer", 0), ("rollout", 0), ("rollout", 1), ("reference", 0)]}
        where = {key: _where(handle) for key, handle in actors.items()}
        first, second = (g.id.hex() for g in reservation.groups)
        assert [where[key][1:] for key in actors] == [(first, False), (first, False), (first, False), (second, False)]
        # Bundle 0 holds the trainer (0.5) and rollout-0 (0.25): full; bundle 1 rollout-1 (0.25); the
        # reference's own group its one GPU. No CUDA here (False above): the engines stay on CPU.
        assert [_bundle_use(first, 0), _bundle_use(first, 1), _bundle_use(second, 0)] == [(0.0, 2), (0.0, 1), (0.0, 1)]
        assert where[("trainer", 0)][0] == where[("rollout", 0)][0]  # colocated: the same GPU
        assert len(where[("trainer", 0)][0]) == 1 and len(where[("reference", 0)][0]) == 1
        assert where[("reference", 0)][0] != where[("trainer", 0)][0]  # a whole GPU of its own
        assert reservation.options("reward", 0) == {}  # no GPUs asked: scheduled as before

        again = reserve(plan, "place-test", timeout_s=30)  # a restarted driver finds the same groups
        assert [g.id for g in again.groups] == [g.id for g in reservation.groups]
        for handle in actors.values():
            ray.kill(handle)
    finally:
        reservation.release()
    assert run_group_names("place-test") == []
    wait_for(lambda: ray.available_resources()["GPU"] == 4, 10, "the GPUs of the removed groups")  # freed async


@pytest.mark.ray
def test_a_plan_the_cluster_cannot_hold_fails_in_one_line(ray_cluster):
    import ray

    from engines.placement import reserve, run_group_names

    too_many = plan_placement({"rollout": RoleSpec(replicas=5, gpus=1)})
    with pytest.raises(RuntimeError) as info:
        reserve(too_many, "place-fail", timeout_s=30)
    assert str(info.value) == ("placement needs 5 GPUs in bundles [[1, 1, 1, 1, 1]], cluster has 4 (4 free); "
                               "lower placement.*.gpus or add GPUs")
    # 3.75 GPUs fit the count, but each 0.75 bundle needs a GPU of its own: five of four. Ray waits; we time out.
    unfit = plan_placement({"rollout": RoleSpec(replicas=5, gpus=0.75)})
    with pytest.raises(RuntimeError, match=r"^placement needs 3\.75 GPUs in bundles \[\[0\.75, 0\.75, 0\.75, 0\.75, "
                                           r"0\.75\]\], cluster has 4 \("):
        reserve(unfit, "place-fail", timeout_s=2)
    assert run_group_names("place-fail") == []  # nothing left reserved
    wait_for(lambda: ray.available_resources()["GPU"] == 4, 10, "the GPUs of the removed groups")


@pytest.mark.ray
def test_a_placed_engine_runs_on_cpu_and_a_changed_placement_replaces_it(ray_cluster, tiny_model_dir):
    import ray

    from engines.actors import describe, run_actor_names, start_engine, stop_engine
    from engines.placement import reserve
    from engines.types import SamplingParams

    half = reserve(plan_placement({"rollout": RoleSpec(gpus=0.5)}), "place-engine", timeout_s=30)
    quarter = None
    try:
        engine = start_engine("rollout/hf", run_name="place-engine", role="rollout", model_path=tiny_model_dir,
                              **half.options("rollout"))
        out = ray.get(engine.generate.remote(["1+2="], SamplingParams(max_new_tokens=3, temperature=0.0)))
        assert out.response_ids.shape == (1, 3) and out.response_ids.device.type == "cpu"
        assert describe(engine)["gpu_ids"] != []
        first = run_actor_names("place-engine", "rollout")
        # The same settings reattach; another bundle (new group) is another fingerprint and replaces the actor.
        same = start_engine("rollout/hf", run_name="place-engine", role="rollout", model_path=tiny_model_dir,
                            **half.options("rollout"))
        assert describe(same)["actor_id"] == describe(engine)["actor_id"]
        quarter = reserve(plan_placement({"rollout": RoleSpec(gpus=0.25)}), "place-engine", timeout_s=30)
        moved = start_engine("rollout/hf", run_name="place-engine", role="rollout", model_path=tiny_model_dir,
                             **quarter.options("rollout"))
        assert run_actor_names("place-engine", "rollout") != first and len(run_actor_names("place-engine", "rollout")) == 1
        assert _where(moved)[1] == quarter.groups[0].id.hex()
        stop_engine(moved)
    finally:
        (quarter or half).release()


@pytest.mark.ray
def test_rollflow_engines_stop_also_removes_the_runs_placement_groups(ray_cluster, monkeypatch):
    import flows.cli as cli
    from engines.placement import release_run, reserve, run_group_names

    reserve(plan_placement({"trainer": RoleSpec(gpus=1)}), "place-cli", timeout_s=30)
    reserve(plan_placement({"trainer": RoleSpec(gpus=1)}), "place-other", timeout_s=30)
    monkeypatch.setattr(cli, "_join_cluster", lambda: None)  # this test's Ray is the cluster
    try:
        cli.engines_stop("place-cli")
        assert run_group_names("place-cli") == []
        assert len(run_group_names("place-other")) == 1  # another run's stay
    finally:
        release_run("place-cli")
        release_run("place-other")
