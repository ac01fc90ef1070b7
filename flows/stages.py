"""Stages: the parts of a pipeline, each done once, and the check that a rerun continues the same run.

A pipeline (``flows/pipeline.py``, one per config ``kind``) is a list of ``Stage`` run in order, each
taking the previous stage's output folder as its input: today base model → SFT (when ``sft:`` is set) →
RLVR; DPO, distillation and evaluation stages take the same shape.

A stage's **key** hashes what its output depends on: the config it reads (``DEPENDS``, without the
``SAFE_CHANGES``), its input (the key in the input folder's marker, or the input's URI: a hub id or a
folder made elsewhere) and the run's data fingerprint (``flows/lineage.py``). Its **done-marker** is its
output folder's ``MANIFEST.json`` (``engines/checkpoint_store.py``), written last with the key in it.
When a pipeline runs (again):

- no marker: the stage runs (RL resumes from the newest complete checkpoint in the run directory);
- a marker with the stage's key: the stage is skipped and its output passed on;
- a marker with another key: ``RerunError``. The folder was made from other inputs (the data or an
  input folder changed under the same config); running on top of it would mix two runs;
- a stage that counts ``steps`` (RL) whose marker holds fewer (``train.steps`` raised): its marker is
  removed and it runs again, continuing from its newest checkpoint to the new step count.

A marker without a key (written before stages had keys) counts as done.

Before any of that, and before Ray or Prefect start, ``check_rerun`` compares the config with the one the
run directory recorded in ``run.json`` and refuses a change outside ``SAFE_CHANGES`` in one line.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Literal

from pydantic import BaseModel
from configs.loader import ConfigError, flat_params
from configs.schema import Config
from engines import checkpoint_store as store
from flows.lineage import dataset_fingerprint
from flows.setup import load_rows

RUN_RECORD = "run.json"

# Config keys a rerun of a run directory may change: none of them changes what the stages compute.
SAFE_CHANGES = frozenset({
    "run.dir",                 # where the run directory is: a moved or copied run continues
    "run.torch_threads",       # threads per engine: the same arithmetic (sums may round differently in the
                               # last bits, as on another machine)
    "eval.every",              # when held-out accuracy is measured: evaluation samples with its own seed
    "checkpoint.every",        # when state is saved: a resume restores it exactly
    "checkpoint.keep",         # how many checkpoints stay on disk
    "tracking.flush_every_s",  # when metrics are sent to MLflow
    "tracking.sample_every",   # which sample tables are logged
    "tracking.num_samples",
    "reward.workers",          # how scoring is spread over processes: a reward depends only on its sample
    "reward.concurrency",
    "sync.bucket_mb",          # the size of the weight transfers, not the weights
    "rollout.timeout_s",       # how long a hung engine is waited for
    "rollout.vllm.gpu_memory_utilization",  # memory vLLM takes, not what it computes
    "rollout.vllm.cpu_kv_cache_gib",
    "train.steps",             # only raised, and only with constant LR schedules (``_refusal``): the run
                               # continues from its newest checkpoint to the new step count
    *(f"{stage}.{key}" for stage in ("sft", "dpo", "distill") for key in ("eval_every", "checkpoint_every")),
})

# The config each stage's output depends on, by stage, besides its input and the data fingerprint
# (``SAFE_CHANGES`` left out). A section added to the schema that changes a stage's output goes here.
DEPENDS: dict[str, tuple[str, ...]] = {
    "base_model": ("model.tiny", "run.seed"),
    "sft": ("sft", "model.dtype", "run.seed"),
    "rlvr": ("run.seed", "model.dtype", "data", "reward", "rollout", "algorithm", "train", "eval", "sync",
             "placement.rollout.replicas"),  # a step's prompts are split into at least one chunk per replica
    "dpo": ("dpo", "model.dtype", "model.lora", "run.seed"),
    "distill": ("distill", "model.dtype", "model.lora", "run.seed"),
    "eval": ("eval", "rollout.max_new_tokens", "rollout.stop", "reward", "data", "run.seed"),
}
DEPENDS["onpolicy_distill"] = (*DEPENDS["rlvr"], "onpolicy_distill")
DEPENDS["agentic"] = (*(key for key in DEPENDS["rlvr"] if key not in ("data", "reward")), "agentic")


class RerunError(ConfigError):
    """A run directory this config cannot continue; the message is one line saying why and what to do."""


@dataclass(frozen=True)
class Stage:
    """One part of a pipeline. ``run(config, input_uri, tracker)`` makes the folder ``out`` from the previous
    stage's output (None for a first stage) and writes its marker last, with ``stage_key(config, name,
    input_uri)`` in it; it returns ``out``."""

    name: str
    out: str
    run: Callable[[Config, str | None, Any], str]
    steps: int | None = None
    """For a stage that continues from its own checkpoints (RL): the step its marker must reach."""
    root: str | None = None
    """Where the stage keeps its checkpoints (``<root>/checkpoints``), if it has any."""


def data_fingerprint(config: Config, stage: str = "rlvr") -> str:
    """What the data ``stage`` trains on hashes to: the RL rows, or the stage's own rows (``sft.data``, …)."""
    from flows.supervised import stage_rows

    if stage == "base_model":  # its tokenizer is trained on the text of every stage
        own = [stage_rows(config, name) for name in supervised_stages(config) if _own_data(config, name)]
        rows = load_rows(config)
        return dataset_fingerprint(*rows, *[split for splits in own for split in splits]) if own else dataset_fingerprint(*rows)
    if stage == "agentic":  # no rows: the environments come from agentic: (in DEPENDS)
        return dataset_fingerprint([{"env": config.agentic.env}])
    if stage in SUPERVISED and _own_data(config, stage):
        return dataset_fingerprint(*stage_rows(config, stage))
    return dataset_fingerprint(*load_rows(config))


SUPERVISED = ("sft", "dpo", "distill")


def supervised_stages(config: Config) -> list[str]:
    return [name for name in config.stage_names() if name in SUPERVISED]


def _own_data(config: Config, stage: str) -> bool:
    """Whether supervised ``stage`` trains on rows of its own rather than the RL rows."""
    return getattr(config, stage).data.source != "rl"


def input_key(uri: str | None) -> str:
    """What a stage's input is, for its key: the key in the input folder's marker, else the URI itself."""
    if uri is None:
        return ""
    marker = store.read_json(store.join(uri, store.MANIFEST)) or {}
    return marker.get("key", uri)


def stage_key(config: Config, name: str, input_uri: str | None) -> str:
    """The key stage ``name`` writes into its marker, made from ``input_uri``."""
    return _key(config, name, input_key(input_uri), data_fingerprint(config, name))


def _key(config: Config, name: str, upstream: str, data: str) -> str:
    flat = {key: value for key, value in flat_params(config).items() if key not in SAFE_CHANGES}
    keyed = {key: value for key, value in flat.items() if any(_under(key, dep) for dep in DEPENDS[name])}
    payload = json.dumps({"stage": name, "config": keyed, "input": upstream, "data": data}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


Action = Literal["run", "skip", "extend", "replace"]
STAGE_KEY = "stage_key.json"  # in ``<root>/checkpoints``: the key of the stage its checkpoints belong to


def plan(config: Config, stages: list[Stage], start: str | None = None) -> list[tuple[Stage, Action]]:
    """Each stage with what running the pipeline does with it: ``skip`` (done with this key), ``run`` (no
    marker), ``extend`` (fewer steps than asked) or, in a ``pipeline`` run, ``replace`` (done with another
    key: its config, data or input changed); ``start`` is the first stage's input. Reads markers only: no
    Ray, no Prefect."""
    upstream, planned = input_key(start), []
    for stage in stages:
        key = _key(config, stage.name, upstream, data_fingerprint(config, stage.name))
        marker = store.read_json(store.join(stage.out, store.MANIFEST))
        changed = marker is not None and marker.get("key", key) != key
        action = "replace" if changed and config.kind == "pipeline" else _action(stage, key, marker)
        planned.append((stage, action))
        upstream = marker.get("key", stage.out) if action == "skip" else key
    return planned


def _action(stage: Stage, key: str, marker: dict | None) -> Action:
    if marker is None:
        return "run"
    if marker.get("key", key) != key:
        raise RerunError(f"stage {stage.name}: {stage.out} was made from other inputs (config, data or input "
                         "model); delete it to redo the stage, or use a new run.dir")
    if stage.steps is None or marker["step"] == stage.steps:
        return "skip"
    if marker["step"] < stage.steps:
        return "extend"
    raise RerunError(f"stage {stage.name}: {stage.out} holds {marker['step']} steps, more than the {stage.steps} "
                     "asked for; use a new run.dir")


def is_done(config: Config, stages: list[Stage], start: str | None = None) -> bool:
    return all(action == "skip" for _, action in plan(config, stages, start))


def run_stages(config: Config, stages: list[Stage], tracker, start: str | None = None) -> str:
    """Run ``stages`` in order from ``start``, skipping done ones; returns the last one's output."""
    uri = start
    for stage, action in plan(config, stages, start):
        if action == "skip":
            uri = stage.out
            continue
        if action in ("extend", "replace"):  # a half-rewritten output must never look done
            fs, path = store.filesystem(store.join(stage.out, store.MANIFEST))
            fs.rm(path)
        key = stage_key(config, stage.name, uri)
        if stage.root is not None:
            claim_checkpoints(stage.root, key)
        uri = stage.run(config, uri, tracker)
    return uri


def claim_checkpoints(root: str, key: str) -> None:
    """Make ``<root>/checkpoints`` hold only checkpoints of the stage with ``key``: those made with another
    key (the stage's config, data or input changed since) are deleted, so a resume never mixes two runs."""
    uri = store.join(root, "checkpoints", STAGE_KEY)
    found = store.read_json(uri)
    if found is not None and found["key"] != key:
        fs, path = store.filesystem(store.join(root, "checkpoints"))
        fs.rm(path, recursive=True)
    if found is None or found["key"] != key:
        store.write_json(uri, {"key": key})


def run_record(config: Config, **fields) -> dict:
    """``run.json``: ``fields`` (MLflow run id, …) and the config a rerun must keep (``check_rerun``)."""
    return {**fields, "config": config.model_dump(mode="json")}


def check_rerun(config: Config) -> list[str]:
    """The accepted changes (``a.b: old -> new``) from the config recorded in the run directory's
    ``run.json``; raise ``RerunError`` naming every other change. A run directory without a record passes."""
    record = store.read_json(store.join(config.run.resolved_dir, RUN_RECORD)) or {}
    if "config" not in record:
        return []
    accepted, refused = [], []
    for key, (old, new) in config_changes(record["config"], config).items():
        change = f"{key}: {_show(old)} -> {_show(new)}"
        reason = _refusal(key, old, new, config)
        if reason is None:
            accepted.append(change)
        else:
            refused.append(change + (f" ({reason})" if reason else ""))
    if refused:
        raise RerunError(f"{config.run.resolved_dir} was started with another config: {', '.join(refused)}; "
                         "rerun with its values or use a new run.dir")
    return accepted


def config_changes(old: dict, new: BaseModel, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """``{"a.b": (old, new)}`` for every field of ``new`` whose value differs from ``old`` (a config dumped
    as JSON): sections compared field by field, other values (lists, option mappings, a section set on
    one side only) whole. A field ``old`` lacks was added to the schema since and is not compared."""
    changes: dict[str, tuple[Any, Any]] = {}
    for name, field in type(new).model_fields.items():
        key = field.alias or name  # as dumped and written in YAML (``async``)
        if key not in old:
            continue
        value = getattr(new, name)
        if isinstance(value, BaseModel) and isinstance(old[key], dict):
            changes.update(config_changes(old[key], value, f"{prefix}{key}."))
        elif (dumped := new.model_dump(mode="json", include={name})[key]) != old[key]:
            changes[f"{prefix}{key}"] = (old[key], dumped)
    return changes


def _refusal(key: str, old: Any, new: Any, config: Config) -> str | None:
    """None for a change ``SAFE_CHANGES`` allows, else why it is refused ("" when it is simply not safe)."""
    if config.kind == "pipeline" and key != "kind":
        return None  # the changed stages and those after them run again (``plan``)
    if key not in SAFE_CHANGES:
        return ""
    if key != "train.steps":
        return None
    if new < old:
        return "train.steps can only be raised"
    schedules = [f"{k}: {v}" for k, v in flat_params(config).items()
                 if k.endswith("optim.schedule") and not k.startswith("sft.") and v != "constant"]
    if schedules:
        return f"{', '.join(schedules)} spans train.steps, so more steps would change the steps already taken"
    return None


def _under(key: str, section: str) -> bool:
    return key == section or key.startswith(section + ".")


def _show(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return text if len(text) <= 40 else text[:39] + "…"
