"""Flows that Prefect deployments run (``infra/prefect/prefect.yaml``), started by a worker.

    rollflow deploy                                   # work pool + every deployment in prefect.yaml
    prefect deployment run rlvr-preset/tiny --param overrides='["run.name=exp1"]'
    prefect deployment run rollflow-preset/dpo --param overrides='["run.name=dpo1", "dpo.beta=0.2"]'
    prefect deployment run rollflow-run/form          # the full typed config, a form in the UI

``rlvr_preset`` and ``run_preset`` (any kind: SFT, DPO, distillation, pipelines) take a preset name or
path plus ``key=value`` overrides, validated when the run starts (a bad key fails the flow run with the
one-line config error). ``run_flow``
(``flows/pipeline.py``) takes the typed ``Config``, so the Prefect UI shows every field as a form.
Either resumes a crashed run from its newest checkpoint when retried (``prefect flow-run retry``),
since the run directory, not Prefect's cache, holds the progress.
"""

from __future__ import annotations

import os

from prefect import flow

from configs.loader import load_config
from flows.cli import _ENV_DEFAULTS
from flows.pipeline import run_flow


def _quiet_defaults() -> None:
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


@flow(name="rlvr-preset", persist_result=False)
def rlvr_preset(preset: str = "tiny", overrides: list[str] | None = None) -> dict:
    """SFT warm start (when the preset has one), then RLVR: ``rollflow run PRESET OVERRIDES…`` as a flow."""
    _quiet_defaults()
    return run_flow(load_config(preset, list(overrides or [])))


@flow(name="rollflow-preset", persist_result=False)
def run_preset(preset: str, overrides: list[str] | None = None, dated: bool = False) -> dict:
    """Any preset by name or path, of any ``kind`` (sft, dpo, distill, onpolicy_distill, pipeline, rlvr), plus
    ``key=value`` overrides: ``rollflow run PRESET OVERRIDES…`` as a flow. Rerun or retried, it resumes.
    ``dated`` (scheduled deployments): ``run.name`` gets the run's scheduled date (``<name>-YYYYMMDD``), so
    each scheduled run is a run of its own rather than a rerun of the last one."""
    _quiet_defaults()
    config = load_config(preset, list(overrides or []))
    if dated:
        from prefect.runtime import flow_run

        day = flow_run.scheduled_start_time.strftime("%Y%m%d")
        config = load_config(preset, [*(overrides or []), f"run.name={config.run.name}-{day}"])
    return run_flow(config)
