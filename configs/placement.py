"""The ``placement`` section of a run's config: replicas and GPUs per role, and the roles that share
devices. ``engines/placement.py`` turns it into Ray placement groups."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from configs.checks import CheckError
from engines.placement import ROLES


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class RolePlacement(Strict):
    replicas: int = Field(1, gt=0)
    """Actors of this role; only rollout may run more than one (reward workers: reward.workers)."""
    gpus: float = Field(0.0, ge=0)
    """GPUs each replica asks Ray for: a fraction of one GPU (0.5) or whole GPUs (2); 0 = CPU, no bundle."""


class PlacementConfig(Strict):
    """Where the engines run; see engines/placement.py. Omit the section for CPU runs."""

    rollout: RolePlacement = RolePlacement()
    """Rollout engines; several replicas split each step's prompts (groups kept whole) and each receives every
    weight sync."""
    trainer: RolePlacement = RolePlacement()
    """The policy trainer."""
    reference: RolePlacement = RolePlacement()
    """The frozen reference (algorithm.kl.coef > 0)."""
    critic: RolePlacement = RolePlacement()
    """The value model (advantage: gae)."""
    reward: RolePlacement = RolePlacement()
    """Each reward worker (their number is reward.workers)."""
    judge: RolePlacement = RolePlacement()
    """The LLM-judge's inference engine (domains with reward: judge)."""
    colocate: list[list[Literal[ROLES]]] = []
    """Groups of roles that share devices, e.g. [[trainer, rollout]]: replica i of each role of a group lands in
    the group's bundle i, one GPU that their gpus share (summing to at most 1). Other roles with GPUs get
    bundles of their own (disaggregated). Roles a run does not start are left out."""
    timeout_s: float = Field(120.0, gt=0)
    """Longest wait for the cluster to grant the bundles; then the run fails saying what is missing."""

    @model_validator(mode="after")
    def _fits(self):
        check_placement(self)
        return self


def check_placement(placement) -> None:
    """A ``placement`` section Ray can reserve: whole GPUs above one per replica, replicas only for rollout,
    each colocated role named once and given a share, a colocated group's shares summing to one GPU at most."""
    for role in ROLES:
        spec = getattr(placement, role)
        if spec.gpus > 1 and spec.gpus != int(spec.gpus):
            raise CheckError((f"{role}.gpus",), f"{spec.gpus:g} GPUs: above 1 a replica asks whole GPUs (Ray shares "
                             "out fractions of one GPU only); use a fraction or a whole number")
        if role != "rollout" and spec.replicas != 1:
            why = ("reward workers are counted by reward.workers; remove it" if role == "reward" else
                   f"only rollout runs several replicas, the {role} is one actor; set it to 1")
            raise CheckError((f"{role}.replicas",), why)
    seen: set[str] = set()
    for i, members in enumerate(placement.colocate):
        keys = (f"colocate.{i}", *(f"{role}.gpus" for role in members))
        if len(members) < 2 or seen & set(members) or len(set(members)) < len(members):
            raise CheckError(keys, f"colocated group {members}: name two or more roles, each in one group only")
        seen |= set(members)
        shares = {role: getattr(placement, role).gpus for role in members}
        if not all(shares.values()) or sum(shares.values()) > 1 + 1e-9:
            asked = " + ".join(f"{role} {gpus:g}" for role, gpus in shares.items())
            raise CheckError(keys, f"colocated roles share one GPU per bundle, each asking a share of it, so their "
                             f"gpus must be above 0 and sum to at most 1 (got {asked}); e.g. 0.5 each")
