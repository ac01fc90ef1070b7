"""A sharded engine's ranks (FSDP2, DeepSpeed ZeRO) as Ray actors, driven as one engine handle.

``start_rank_group`` starts one actor per rank, named ``<run>/<role>.rank<i>#<fingerprint>``, each built
with its ``rank``, the ``world_size`` and the ``rendezvous`` address of rank 0's node, where they form
a process group (``engines.training.distributed.init_ranks``). The ``RankGroup`` it returns stands in for
an actor handle: ``group.method.remote(*args)`` calls ``method`` on every rank, in the same order on each
(their collectives run in step), and returns a ref to rank 0's result. When a rank raises or dies, that
ref raises its error (the first to fail, not a peer's timeout) and every rank is killed: a process group
with a failed member cannot go on, and the run resumes from its checkpoint with fresh ranks.
"""

from __future__ import annotations

from typing import Any

import ray

from engines.actors import NAMESPACE, _responsive, engine_actor_name, run_actor_names, start_engine, stop_named


class RankGroup:
    """The ranks of one sharded engine; ``group.method.remote(...)`` runs ``method`` on all of them."""

    def __init__(self, ranks: list) -> None:
        self.ranks = list(ranks)

    def __getattr__(self, name: str) -> "GroupMethod":
        if name.startswith("_") and name not in ("__ray_call__", "__ray_ready__"):
            raise AttributeError(name)
        return GroupMethod(self.ranks, name)

    def __len__(self) -> int:
        return len(self.ranks)



class GroupMethod:
    def __init__(self, ranks: list, name: str) -> None:
        self.ranks, self.name = ranks, name

    def remote(self, *args, **kwargs) -> ray.ObjectRef:
        refs = [getattr(handle, self.name).remote(*args, **kwargs) for handle in self.ranks]
        if len(refs) == 1:
            return refs[0]
        return _rank0_result.remote(refs, self.ranks)


@ray.remote(num_cpus=0, max_retries=0)
def _rank0_result(refs: list, ranks: list) -> Any:
    """Rank 0's result once every rank finished; the first error of any rank (every rank then killed)."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done[0])
        except Exception:
            for handle in ranks:
                ray.kill(handle, no_restart=True)
            raise
    return ray.get(refs[0])


def rank_role(role: str, rank: int) -> str:
    return f"{role}.rank{rank}"


def _live(run_name: str, role: str) -> list[str]:
    """Live actors of ``role`` (one actor) or of its ranks (``role.rank<i>``)."""
    return [name for name in run_actor_names(run_name)
            if name.split("/", 1)[1].split("#")[0] == role or name.split("/", 1)[1].startswith(f"{role}.rank")]


def start_rank_group(kind: str, *, run_name: str, role: str, world_size: int, reuse: bool = True,
                     placement: list[dict] | None = None, **kwargs: Any) -> RankGroup:
    """``world_size`` actors of engine ``kind`` (``start_engine``'s), rank ``i`` placed by ``placement[i]``
    (``start_engine`` keywords: ``num_gpus``, ``scheduling_strategy``; a rank without a strategy runs on this
    driver's node). With ``reuse``, a complete live group built alike is reattached; otherwise (or when
    a rank is missing) every live actor of ``role`` is replaced. ``kwargs`` go to every rank's constructor."""
    placement = placement or [{}] * world_size
    if len(placement) != world_size:
        raise ValueError(f"{len(placement)} placements for {world_size} ranks")
    placement = [where if where.get("scheduling_strategy") else {**where, "scheduling_strategy": _this_node()}
                 for where in placement]
    ranks_kwargs = [dict(kwargs, rank=i, world_size=world_size, **placement[i]) for i in range(world_size)]
    if reuse:
        found = [_find(kind, run_name, rank_role(role, i), args) for i, args in enumerate(ranks_kwargs)]
        if all(found) and len(_live(run_name, role)) == world_size:
            return RankGroup(found)
    for name in _live(run_name, role):
        stop_named(name)
    where = placement[0].get("scheduling_strategy")
    rendezvous = ray.get(_address.options(scheduling_strategy=where).remote())
    return RankGroup([start_engine(kind, run_name=run_name, role=rank_role(role, i), reuse=False,
                                   unfingerprinted={"rendezvous": rendezvous}, **args)
                      for i, args in enumerate(ranks_kwargs)])


def _find(kind: str, run_name: str, role: str, args: dict):
    """The live, answering actor of ``role`` built from ``kind`` and ``args``, else None."""
    name = engine_actor_name(kind, run_name, role, **args)
    try:
        handle = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None
    return handle if _responsive(handle, timeout_s=60) else None


def _this_node():
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


@ray.remote(num_cpus=0, max_retries=0)
def _address() -> str:
    from engines.training.distributed import free_address

    return free_address()
