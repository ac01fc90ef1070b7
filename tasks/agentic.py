from __future__ import annotations

from prefect import task

from engines.actors import get_from_engines
from tasks.common import TASK_DEFAULTS


@task(name="run_episodes", **TASK_DEFAULTS)
def run_episodes(env_workers: list, rollout_engines: list, reward_worker, specs: list, mode: str,
                 timeout_s: float, temperature: float | None = None, transcripts: int = 0):
    """Run the episodes ``specs`` on the environment workers, whole groups each, worker i against rollout
    engine i mod replicas (``EnvWorker.collect``); ``(rollouts_ref, returns_ref, summaries)`` with the
    summaries in batch order. No retry: the step's checkpointed resume reruns it from the same seeds."""
    groups = list(dict.fromkeys(spec.group for spec in specs))
    calls = []
    for i, worker in enumerate(env_workers):
        mine = set(groups[i::len(env_workers)])
        part = [spec for spec in specs if spec.group in mine]
        if part:
            refs = worker.collect.options(num_returns=3).remote(part, rollout_engines[i % len(rollout_engines)], mode,
                                                                temperature, transcripts if not calls else 0)
            calls.append((worker, part, refs))
    summaries = get_from_engines([refs[2] for _, _, refs in calls], [(w, refs[2]) for w, _, refs in calls], timeout_s)
    if len(calls) == 1:
        [(_, _, (rollouts_ref, returns_ref, _))] = calls
    else:  # one batch, the workers' parts in turn
        flat = [ref for _, _, refs in calls for ref in refs[:2]]
        rollouts_ref, returns_ref = reward_worker.join.options(num_returns=2).remote([None] * len(calls), *flat)
    return rollouts_ref, returns_ref, [s for part in summaries for s in part]
