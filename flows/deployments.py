"""Flows that Prefect deployments run (``infra/prefect/prefect.yaml``), started by a worker.

    rollflow deploy                                   # work pool + every deployment in prefect.yaml
    prefect deployment run rlvr-preset/tiny --param overrides='["run.name=exp1"]'
    prefect deployment run rollflow-run/form          # the full typed config, a form in the UI

``rlvr_preset`` takes a preset name or path plus ``key=value`` overrides, validated when the run
starts (a bad key fails the flow run with the one-line config error). ``run_flow``
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


@flow(name="sft-preset", persist_result=False)
def sft_preset(preset: str = "quickstart", overrides: list[str] | None = None) -> str:
    """Only the SFT stage of a preset with an ``sft:`` section; returns the tuned model's folder
    (``<run.dir>/sft_model``), registered like a final model."""
    from flows.pipeline import open_tracking, publish_model, run_pipeline
    from flows.setup import ensure_ray
    from flows.stages import check_rerun

    _quiet_defaults()
    config = load_config(preset, list(overrides or []))
    if config.sft is None:
        raise ValueError(f"preset {preset!r} has no sft: section to run")
    check_rerun(config)
    ensure_ray()
    tracker = open_tracking(config)
    out = run_pipeline(config, tracker, last="sft")  # the stages up to SFT, each done once
    publish_model(config, tracker, out, artifact_path="sft_model",
                  name=f"{config.tracking.registered_model_name or config.run.name}-sft")
    tracker.finish()
    return out
