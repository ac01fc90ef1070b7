"""The whole run behind ``rollflow run``: the stages of the config's ``kind`` in order, in one MLflow run.

``kind: rlvr``: the base model (``model.path``, or a tiny model built into ``base_model/``) → SFT warm
start (when ``sft:`` is set, into ``sft_model/``) → RLVR (into ``final/``). Idempotent (``flows/stages.py``):
done stages are skipped, an interrupted one resumes (SFT from its start, RL from its newest complete
checkpoint), a finished run returns its summary at once, a raised ``train.steps`` continues a finished
run. A rerun whose config differs from the first attempt's (``run.json``) in a key outside
``stages.SAFE_CHANGES`` is refused before anything starts.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from prefect import flow

from configs.loader import dump_config, flat_params
from configs.schema import Config
from engines import checkpoint_store as store
from flows.rlvr import rlvr_flow
from flows.lineage import config_hash, lineage_tags
from flows.evaluate import evaluate_flow
from flows.setup import (check_prompt_lengths, checkpoint_root, ensure_ray, load_rows, stage_dir,
                         start_prefect_server)
from flows.stages import (RUN_RECORD, Stage, check_rerun, data_fingerprint, input_key, is_done, plan, run_record,
                          run_stages, stage_key, supervised_stages)
from flows.supervised import stage_rows, supervised_flow
from flows.tracking import RunTracker, redact, tracking_uri


def build_base_model(config: Config, _input: None, _tracker: RunTracker) -> str:
    """A tiny model (``model.tiny``) with a tokenizer trained on the text of every stage's rows, built into
    ``<run.dir>/base_model`` (local or s3://)."""
    from engines.models import TinyModelSpec, build_tiny_model

    out = store.join(config.run.resolved_dir, "base_model")
    with tempfile.TemporaryDirectory() as tmp:
        built = build_tiny_model(Path(tmp) / "model", tokenizer_texts(config),
                                 TinyModelSpec(**config.model.tiny.model_dump()), seed=config.run.seed)
        files = store.put_folder(str(built), out)
    store.write_manifest(out, 0, files, key=stage_key(config, "base_model", None))
    return out


def tokenizer_texts(config: Config) -> list[str]:
    """The text a tiny model's tokenizer is trained on: the RL rows, and the rows of each supervised stage
    with data of its own, as the chat format renders them."""
    if config.agentic is not None and "agentic" in config.stage_names():  # the environment's text, not RL rows
        from engines.agentic.warm_start import environment_texts

        section = config.agentic
        texts = environment_texts(section.env, dict(section.env_options), 200, config.run.seed + 17, section.max_turns,
                                  section.system_prompt)
    else:
        texts = [row["prompt"] + row["answer"] for row in load_rows(config)[0]]
    for stage in supervised_stages(config):
        if getattr(config, stage).data.source != "rl":
            from engines.data.synthetic import texts_for_tokenizer

            train, heldout = stage_rows(config, stage)
            texts += texts_for_tokenizer(train + heldout)
    return texts


def _check_input(config: Config, model_path: str) -> None:
    """Before a stage starts engines on ``model_path``: every prompt fits the model with its response."""
    train_rows, heldout_rows = load_rows(config)
    check_prompt_lengths(config, model_path, train_rows + heldout_rows)


def supervised_stage(name: str):
    """The runner of supervised stage ``name`` (sft, dpo, distill): ``flows/supervised.py``."""
    def run(config: Config, model_path: str, tracker: RunTracker) -> str:
        return supervised_flow(config, name, model_path, tracker, stage_key(config, name, model_path))
    return run


def rl_stage(name: str):
    """The runner of RL stage ``name`` (rlvr, onpolicy_distill, agentic): ``flows/rlvr.py``."""
    def run(config: Config, model_path: str, tracker: RunTracker) -> str:
        if name != "agentic":  # agentic prompts are the environments' observations, limited by agentic.max_context
            _check_input(config, model_path)
        rlvr_flow(config, model_path, tracker.uri, tracker.run_id, stage=name)
        return stage_dir(config, name)
    return run


def eval_stage(config: Config, model_path: str, tracker: RunTracker) -> str:
    _check_input(config, model_path)
    return evaluate_flow(config, model_path, tracker, stage_key(config, "eval", model_path))


def stages_of(config: Config) -> tuple[str | None, list[Stage]]:
    """``(start, stages)``: the first stage's input model and the stages of ``config.kind`` in order
    (``Config.stage_names``), after the tiny base model when ``model.source`` is tiny."""
    start = config.model.path if config.model.source == "hf" else None
    stages = [Stage("base_model", store.join(config.run.resolved_dir, "base_model"), build_base_model)] if start is None else []
    for name in config.stage_names():
        if name in ("rlvr", "onpolicy_distill", "agentic"):
            stages.append(Stage(name, stage_dir(config, name), rl_stage(name), steps=config.train.steps,
                                root=checkpoint_root(config, name)))
        elif name == "eval":
            stages.append(Stage(name, stage_dir(config, name), eval_stage))
        else:
            stages.append(Stage(name, stage_dir(config, name), supervised_stage(name), root=checkpoint_root(config, name)))
    return start, stages


def final_model_dir(config: Config) -> str:
    """The run's final model: the output of its last training stage."""
    return stage_dir(config, [name for name in config.stage_names() if name != "eval"][-1])


def is_finished(config: Config) -> bool:
    """Every stage done (reads markers only); raises ``stages.RerunError`` when one was made from other inputs."""
    start, stages = stages_of(config)
    return is_done(config, stages, start)


def run_pipeline(config: Config, tracker: RunTracker, last: str | None = None) -> str:
    """Run the stages of ``config.kind`` in order, up to and including the one named ``last`` (default: all);
    returns the output of the last one run. A ``pipeline`` run gives each stage its own MLflow run, nested
    under ``tracker``'s (``nested_stage``)."""
    start, stages = stages_of(config)
    names = [stage.name for stage in stages]
    chosen = stages[: names.index(last) + 1] if last else stages
    for stage, action in plan(config, chosen, start):
        print(f"stage {stage.name}: {ACTIONS[action]}", flush=True)
    if config.kind == "pipeline":
        chosen = [nested_stage(stage) for stage in chosen]
    return run_stages(config, chosen, tracker, start)


ACTIONS = {"skip": "done, skipped", "run": "runs (or resumes from its newest checkpoint)",
           "extend": "continues to more steps", "replace": "changed since it ran: runs again"}


def nested_stage(stage: Stage) -> Stage:
    """``stage`` run in an MLflow run of its own, nested under the pipeline's (``stage_run``), tagged with its
    input model; its output model is registered as ``<registered name>-<stage>`` with that lineage."""
    def run(config: Config, input_uri: str | None, parent: RunTracker) -> str:
        child = stage_run(config, parent, stage.name, stage_key(config, stage.name, input_uri), input_uri)
        child.client.update_run(child.run_id, status="RUNNING")  # again, after a killed attempt
        try:
            out = stage.run(config, input_uri, child)
            if stage.name not in ("base_model", "eval"):
                name = f"{config.tracking.registered_model_name or config.run.name}-{stage.name}"
                publish_model(config, child, out, f"{stage.name}_model", name=name)
        except BaseException:
            child.finish("FAILED")
            raise
        child.finish()
        return out

    return dataclasses.replace(stage, run=run)


def stage_run(config: Config, parent: RunTracker, stage: str, key: str, input_uri: str | None) -> RunTracker:
    """The MLflow run of a pipeline stage, nested under ``parent``: the same one when the stage resumes
    (``run.json`` maps each stage key to its run), a new one when the key changed (config, data or input)."""
    record_uri = store.join(config.run.resolved_dir, RUN_RECORD)
    record = store.read_json(record_uri) or {}
    runs = record.get("stage_runs", {})
    if key in runs:
        return RunTracker(parent.uri, runs[key])
    tags = {**lineage_tags(config, *load_rows(config)), "mlflow.parentRunId": parent.run_id,
            "rollflow.stage": stage, "rollflow.stage_key": key, "rollflow.input_model": input_uri or "",
            "rollflow.input_key": input_key(input_uri), "rollflow.dataset_fingerprint": data_fingerprint(config, stage)}
    child = RunTracker.create(parent.uri, config.tracking.experiment, f"{config.run.name}.{stage}",
                              flat_params(config), dump_config(config), tags=tags)
    store.write_json(record_uri, {**record, "stage_runs": {**runs, key: child.run_id}})
    return child


def open_tracking(config: Config) -> RunTracker:
    """The run's MLflow run: created on the first attempt (tagged with its lineage) and recorded with the
    config in ``run.json``; the same one on every resume. A resume with changes ``check_rerun`` accepts
    records the new config and tags the run with every accepted change (MLflow params never change)."""
    run_dir = config.run.resolved_dir
    record_uri = store.join(run_dir, RUN_RECORD)
    record = store.read_json(record_uri)
    uri = tracking_uri(run_dir)
    if record is None:
        tracker = RunTracker.create(uri, config.tracking.experiment, config.run.name, flat_params(config),
                                    dump_config(config), tags=lineage_tags(config, *load_rows(config)))
        store.write_json(record_uri, run_record(config, mlflow_run_id=tracker.run_id, tracking_uri=redact(uri),
                                                name=config.run.name))
        return tracker
    tracker = RunTracker(uri, record["mlflow_run_id"])
    changes = check_rerun(config)
    if changes or "config" not in record:  # (a record from before configs were recorded gets this one)
        changes = [*record.get("changes", []), *changes]
        if changes:
            tracker.client.set_tag(tracker.run_id, "rollflow.config_changes", redact(", ".join(changes))[:5000])
            tracker.client.set_tag(tracker.run_id, "rollflow.config_hash", config_hash(config))
        store.write_json(record_uri, {**record, **run_record(config), "changes": changes})
    return tracker


def publish_model(config: Config, tracker: RunTracker, folder: str, artifact_path: str,
                  name: str | None = None) -> int | None:
    """Log ``folder`` as the run's ``artifact_path`` artifact and register it as ``name`` (default
    ``tracking.registered_model_name`` or the run name), each once per model: a rerun after a crash between
    the two finishes what is missing. A run extended past its first end (``train.steps`` raised) logs its
    new model as ``<artifact_path>_step_<N>`` and registers it as a new version, so earlier versions keep
    their weights. Returns the registered version (None when registering is off)."""
    client, run_id = tracker.client, tracker.run_id
    step = str(store.read_json(store.join(folder, store.MANIFEST))["step"])
    first_tag = f"rollflow.{artifact_path}_step"  # the step of the model logged as ``artifact_path``
    first = client.get_run(run_id).data.tags.get(first_tag)
    if first is None:  # set before logging; a model logged before models had steps is this one
        client.set_tag(run_id, first_tag, step)
        first = step
    path = artifact_path if first == step else f"{artifact_path}_step_{int(step):06d}"
    if config.tracking.log_model and not client.list_artifacts(run_id, path):
        tracker.log_dir(store.local_copy(folder), path)
    if not config.tracking.register_model:
        return None
    name = name or config.tracking.registered_model_name or config.run.name
    versions = client.search_model_versions(f"run_id='{run_id}' and name='{name}'")
    done = [v for v in versions if v.tags.get("rollflow.step", step) == step]
    if done:
        return int(done[0].version)
    tags = {k: v for k, v in client.get_run(run_id).data.tags.items() if k.startswith("rollflow.") and k != first_tag}
    return tracker.register_model(name, path if config.tracking.log_model else None, folder,
                                  {**tags, "rollflow.mlflow_run_id": run_id, "rollflow.step": step})


def publish_final_model(config: Config, tracker: RunTracker) -> int | None:
    return publish_model(config, tracker, final_model_dir(config), "final_model")


def summary(config: Config) -> dict:
    final = final_model_dir(config)
    state = store.read_json(store.join(final, "state.json")) or {}
    if "eval" in config.stage_names():
        state = {**state, **(store.read_json(store.join(stage_dir(config, "eval"), "state.json")) or {})}
    return {"final_dir": final, "heldout_accuracy": state.get("heldout_accuracy", {}), "heldout": state.get("heldout", {}),
            "mlflow_run_id": state.get("mlflow_run_id"), "already_finished": False}


def finished_summary(config: Config) -> dict:
    """Summary of a finished run; also publishes the model and closes the MLflow run if the last attempt
    died just before that."""
    tracker = open_tracking(config)
    version = publish_final_model(config, tracker)
    tracker.finish()
    return {**summary(config), "registered_version": version, "already_finished": True}


@flow(name="rollflow-run", persist_result=False)
def run_flow(config: Config = Config()) -> dict:
    """Run (or resume, or extend) ``config`` to completion; returns where the model is and its held-out
    accuracy."""
    check_rerun(config)
    if is_finished(config):
        return finished_summary(config)
    ensure_ray()
    start_prefect_server()  # before the first flow, so it runs at low priority
    tracker = open_tracking(config)
    tracker.client.update_run(tracker.run_id, status="RUNNING")  # again, after a failed attempt
    try:
        run_pipeline(config, tracker)
        version = publish_final_model(config, tracker)
    except BaseException:
        tracker.finish("FAILED")  # a crash (SIGKILL) leaves it RUNNING; the next attempt carries on
        raise
    tracker.finish()
    return {**summary(config), "registered_version": version}
