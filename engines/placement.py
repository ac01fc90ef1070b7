"""Placement of a run's engine actors on GPUs: a plan (pure data), then Ray placement groups that hold it.

``plan_placement`` maps each role's replicas and GPUs, and the roles that share devices, to bundles:

- a **colocated** group of roles takes one bundle per replica index; bundle ``i`` holds replica ``i`` of
  every role of the group that has one, and its GPUs are the sum of their shares (at most one GPU: they
  share that device, each actor asking Ray for its own fraction of it);
- any other role with GPUs is **disaggregated**: one bundle of its own per replica;
- a role without GPUs gets no bundle and is scheduled by Ray as before (CPU).

Each colocated group and each disaggregated role is one placement group (strategy PACK: its bundles on as
few nodes as fit). ``reserve`` creates them, named ``<run>/placement-<i>#<hash of its bundles>``, so a
driver that restarts finds the groups its live actors run in; the run's groups of another plan are
removed first (their actors were built for another placement and die with them).

A GPU share is Ray's bookkeeping, not a memory limit: the actor sees the whole device (``CUDA_VISIBLE_DEVICES``
from Ray) and colocated engines offload or sleep between phases to make room for each other.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

ROLES = ("rollout", "trainer", "reference", "critic", "reward", "judge")
"""The roles a placement names; ``reward`` counts reward workers, ``judge`` is the LLM-judge's engine."""


@dataclass(frozen=True)
class RoleSpec:
    """How many actors a role runs and the GPUs each asks for (a fraction of one, or whole GPUs)."""

    replicas: int = 1
    gpus: float = 0.0


@dataclass(frozen=True)
class Slot:
    """Where actor ``(role, replica)`` runs: bundle ``bundle`` of placement group ``group``, asking
    ``num_gpus``; ``group`` and ``bundle`` are None for an actor without GPUs (no bundle)."""

    group: int | None
    bundle: int | None
    num_gpus: float


NO_SLOT = Slot(None, None, 0.0)


@dataclass(frozen=True)
class Plan:
    """``groups[g][b]``: GPUs of bundle ``b`` of placement group ``g``; ``slots[(role, replica)]``: its place."""

    groups: tuple[tuple[float, ...], ...]
    slots: dict[tuple[str, int], Slot]

    @property
    def gpus(self) -> float:
        return round(sum(sum(bundles) for bundles in self.groups), 4)


def plan_placement(roles: dict[str, RoleSpec], colocate: list[list[str]] = ()) -> Plan:
    """The bundles and each actor's slot for the run's ``roles`` (those it starts); groups of ``colocate``
    name roles that share devices (roles the run does not start are left out of them)."""
    groups: list[tuple[float, ...]] = []
    slots: dict[tuple[str, int], Slot] = {}
    for members in colocate:
        members = [role for role in members if role in roles]
        if not members:
            continue
        bundles = []
        for b in range(max(roles[role].replicas for role in members)):
            sharing = [role for role in members if b < roles[role].replicas]
            slots.update({(role, b): Slot(len(groups), b, roles[role].gpus) for role in sharing})
            bundles.append(round(sum(roles[role].gpus for role in sharing), 4))  # Ray counts in 1e-4 units
        if not all(bundles):
            raise ValueError(f"colocated roles {members} ask no GPUs; colocation shares GPUs, give them a share")
        groups.append(tuple(bundles))
    for role, spec in roles.items():
        if any((role, r) in slots for r in range(spec.replicas)):
            continue
        if spec.gpus == 0:
            slots.update({(role, r): NO_SLOT for r in range(spec.replicas)})
            continue
        slots.update({(role, r): Slot(len(groups), r, spec.gpus) for r in range(spec.replicas)})
        groups.append((spec.gpus,) * spec.replicas)
    return Plan(tuple(groups), slots)


@dataclass
class Reservation:
    """A plan's placement groups, reserved on the cluster; ``options`` places one actor in them."""

    plan: Plan
    groups: list = field(default_factory=list)  # ray.util.placement_group.PlacementGroup per plan group

    def options(self, role: str, replica: int = 0) -> dict:
        """``start_engine`` keywords of actor ``(role, replica)``: its GPUs and, with a bundle, the Ray
        scheduling strategy that puts it there (none without GPUs: scheduled as before)."""
        slot = self.plan.slots.get((role, replica), NO_SLOT)
        if slot.group is None:
            return {}
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self.groups[slot.group], placement_group_bundle_index=slot.bundle)
        return {"num_gpus": slot.num_gpus, "scheduling_strategy": strategy}

    def release(self) -> None:
        """Remove the placement groups (after the actors in them are stopped)."""
        import ray

        for group in self.groups:
            ray.util.remove_placement_group(group)
        self.groups = []


def group_name(run_name: str, index: int, bundles: tuple[float, ...]) -> str:
    return f"{run_name}/placement-{index}#{hashlib.sha256(repr(bundles).encode()).hexdigest()[:12]}"


def run_group_names(run_name: str) -> list[str]:
    """Names of the run's placement groups that are not removed."""
    import ray

    return sorted(g["name"] for g in ray.util.placement_group_table().values()
                  if g["name"].startswith(f"{run_name}/placement-") and g["state"] != "REMOVED")


def release_run(run_name: str, keep: tuple[str, ...] = ()) -> None:
    """Remove the run's placement groups but ``keep`` (their actors die with them)."""
    import ray

    for name in run_group_names(run_name):
        if name not in keep:
            ray.util.remove_placement_group(ray.util.get_placement_group(name))


def reserve(plan: Plan, run_name: str, timeout_s: float, detached: bool = False) -> Reservation:
    """Placement groups of ``plan`` for run ``run_name``: the live ones of the same name, else new ones
    (``detached`` outlive the driver); raise ``RuntimeError`` (one line: what was asked, what the cluster
    has) when they are not ready within ``timeout_s``. A plan without GPUs reserves nothing."""
    if not plan.groups:
        return Reservation(plan)
    import ray

    names = [group_name(run_name, i, bundles) for i, bundles in enumerate(plan.groups)]
    release_run(run_name, keep=tuple(names))
    live, have = set(run_group_names(run_name)), ray.cluster_resources().get("GPU", 0.0)
    groups = []
    if plan.gpus <= have:  # else no wait can help
        groups = [ray.util.get_placement_group(name) if name in live else
                  ray.util.placement_group([{"GPU": gpus} for gpus in bundles], strategy="PACK", name=name,
                                           lifetime="detached" if detached else None)
                  for name, bundles in zip(names, plan.groups)]
        ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=timeout_s)
        if len(ready) == len(groups):
            return Reservation(plan, groups)
    free = ray.available_resources().get("GPU", 0.0)
    Reservation(plan, groups).release()
    bundles = ", ".join("[" + ", ".join(f"{gpus:g}" for gpus in group) + "]" for group in plan.groups)
    raise RuntimeError(f"placement needs {plan.gpus:g} GPUs in bundles [{bundles}], cluster has {have:g} ({free:g} "
                       "free); lower placement.*.gpus or add GPUs")
