"""``infra/prefect/prefect.yaml`` without a server: every deployment's entrypoint exists and takes its
parameters, every preset it names loads with its overrides, every schedule is a valid cron that ships
paused, and scheduled distillation cancels a run that would overlap one still going."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
import yaml
from prefect.client.schemas.schedules import CronSchedule

from configs.loader import load_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENTS = {d["name"]: d for d in yaml.safe_load((ROOT / "infra/prefect/prefect.yaml").read_text())["deployments"]}


def test_sft_dpo_distillation_and_pipeline_deployments_exist():
    assert {"sft", "dpo", "distill-offline", "distill-onpolicy", "pipeline"} <= set(DEPLOYMENTS)
    kinds = {name: load_config(d["parameters"]["preset"], d["parameters"]["overrides"]).kind
             for name, d in DEPLOYMENTS.items() if name in {"sft", "dpo", "distill-offline", "distill-onpolicy", "pipeline"}}
    assert kinds == {"sft": "sft", "dpo": "dpo", "distill-offline": "distill", "distill-onpolicy": "onpolicy_distill",
                     "pipeline": "pipeline"}


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_entrypoint_takes_the_parameters_and_the_preset_loads(name):
    deployment = DEPLOYMENTS[name]
    path, function = deployment["entrypoint"].split(":")
    flow = getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), function)
    accepted = inspect.signature(flow.fn).parameters
    parameters = deployment.get("parameters", {})
    assert set(parameters) <= set(accepted), (name, sorted(parameters), sorted(accepted))
    if "preset" in parameters:
        load_config(parameters["preset"], parameters.get("overrides", []))  # raises ConfigError on a bad one


@pytest.mark.parametrize("name", sorted(n for n, d in DEPLOYMENTS.items() if d.get("schedules")))
def test_schedules_are_valid_crons_that_ship_paused(name):
    for schedule in DEPLOYMENTS[name]["schedules"]:
        CronSchedule(cron=schedule["cron"], timezone=schedule["timezone"])  # Prefect's own check: raises when invalid
        assert schedule["active"] is False and schedule["timezone"] == "UTC"


@pytest.mark.parametrize("name", ["distill-offline", "distill-onpolicy"])
def test_scheduled_distillation_runs_one_at_a_time_and_each_run_is_its_own(name):
    deployment = DEPLOYMENTS[name]
    assert deployment["concurrency_limit"] == {"limit": 1, "collision_strategy": "CANCEL_NEW"}
    assert deployment["parameters"]["dated"] is True  # run.name gets the scheduled date
