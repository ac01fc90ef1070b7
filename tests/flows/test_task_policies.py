"""Retry and cache settings of every Prefect task, set on purpose: a task that changes state (a train
step, a checkpoint) never retries blindly; pure ones (seeded generation, scoring, evaluation) may, and so may the idempotent weight sync; no task
result is cached, so neither two experiments nor two attempts can share one."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

import pytest
from prefect.cache_policies import NO_CACHE
from prefect.tasks import Task

import tasks

NEVER_RETRIED = {"train", "supervised_train", "checkpoint", "restore", "save_model", "compute_advantages",
                 "encode_rows", "score_reference", "score_teacher"}  # (scoring writes a cache: computed once)
MAY_RETRY = {"generate_and_score", "evaluate", "join_rounds", "rollout_samples",  # pure: seeded sampling, deterministic rewards
             "supervised_eval",  # no gradient
             "sync_weights", "set_memory_phase"}  # idempotent: the same weights and version again (checked by
                                                  # checksum); offload/sleep and reload/wake of what already moved do nothing


def _all_tasks() -> dict[str, Task]:
    found = {}
    for module in pkgutil.iter_modules(tasks.__path__):
        for value in vars(importlib.import_module(f"tasks.{module.name}")).values():
            if isinstance(value, Task):
                found[value.name] = value
    return found


def test_every_task_has_a_deliberate_retry_and_cache_policy():
    found = _all_tasks()
    assert NEVER_RETRIED | MAY_RETRY <= set(found), sorted(found)
    for name, task in found.items():
        assert task.cache_policy is NO_CACHE, name
        assert task.persist_result is False, name
        if name in MAY_RETRY:
            assert task.retries >= 1, name
        else:
            assert task.retries == 0, name


def test_reward_workers_warm_up_the_rewards_of_the_run():
    from configs.loader import load_config
    from flows.setup import domain_rewards, load_domains

    def run_rewards(preset):  # what start_rl_engines hands its reward workers
        return domain_rewards(load_domains(load_config(preset, [])))

    assert run_rewards("quickstart") == ("math",)
    assert run_rewards("rlvr/multi_domain_tiny") == ("code", "ifeval", "judge", "math", "reasoning_gym")


def test_the_judge_engine_serves_the_judge_domains_of_the_run_single_domain_runs_too():
    from configs.loader import load_config
    from flows.rlvr import judge_model_path
    from flows.setup import load_domains

    def judge(preset, overrides=()):
        return judge_model_path(load_domains(load_config(preset, list(overrides))), "/policy")

    assert judge("quickstart") is None
    assert judge("quickstart", ["reward.name=judge"]) == "/policy"  # reward.name, not data.domains
    assert judge("rlvr/multi_domain_tiny") == "/policy"  # its judge domain sets no model_path
    domains = load_domains(load_config("rlvr/multi_domain_tiny", []))
    judge_domain = next(d for d in domains if d.reward == "judge")
    judge_domain.reward_options["model_path"] = "/judge"
    assert judge_model_path(domains, "/policy") == "/judge"
    domains.append(dataclasses.replace(judge_domain, name="qa2", reward_options={"model_path": "/other"}))
    with pytest.raises(ValueError, match=r"different models \['/judge', '/other'\]"):
        judge_model_path(domains, "/policy")
