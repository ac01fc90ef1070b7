"""The supervised stages: SFT, DPO and offline distillation, one recipe.

- **SFT**: next-token cross-entropy on assistant (answer) tokens only, each turn's end-of-turn token
  included; the mean runs over the loss tokens of the whole optimizer step. Each micro-batch's sequences
  are packed without padding (``train.packing``).
- **DPO** (Rafailov et al. 2023, and the losses of ``engines.algorithms.preference``): the reference's
  summed log-probs of every chosen and rejected answer are computed once and cached, keyed by the data,
  the reference model and the tokenization; then pairs train with ``dpo.loss``.
- **Offline distillation** (Hinton et al. 2015; GKD's divergences, Agarwal et al. 2024): the teacher scores
  the data once; the cache keeps its top-k tokens per answer position with their full-vocabulary log-probs
  (the rest as one tail bucket); the student trains on ``distill.divergence`` mixed with cross-entropy.

Every step: the step's rows (a seeded order, one epoch after another) → a batch built on a Ray worker →
one optimizer step → metrics; held-out metrics before the first step and every ``eval_every`` steps (with
``eval_every`` 0: after the last only), and always after the last; a checkpoint
(model, optimizer, LR schedule, RNG, data position; manifest last) every ``checkpoint_every`` steps. A killed
stage resumes from its newest checkpoint and ends with the weights of an uninterrupted one.

Launch: ``rollflow run configs/sft/tiny_chat.yaml`` (kind sft), ``configs/dpo/tiny.yaml``,
``configs/distill/offline_tiny.yaml``; ``rollflow run configs/quickstart.yaml`` runs SFT as RL's warm start.
"""

from __future__ import annotations

import hashlib
import json

from prefect import flow, get_run_logger
from prefect.utilities.annotations import quote

from configs.schema import Config
from engines import checkpoint_store as store
from engines.actors import start_engine, stop_engine
from engines.algorithms.objective import DistillObjective, DPOObjective, SFTObjective
from engines.data.sampler import take
from engines.models import load_tokenizer
from engines.training.torch import OptimSpec
from flows.progress import StageProgress
from flows.setup import checkpoint_root, load_rows, reserve_placement, stage_dir, start_train_engine
from flows.tracking import RunTracker
from tasks.checkpoint import checkpoint, restore, save_model
from tasks.supervised import encode_rows, score_reference, score_teacher, supervised_eval, supervised_train


def stage_rows(config: Config, stage: str) -> tuple[list[dict], list[dict]]:
    """``(train_rows, heldout_rows)`` of supervised stage ``stage`` (``<stage>.data``): the RL rows as
    ``{"prompt", "completion"}`` text, rows read from files, or the built-in synthetic task."""
    data = getattr(config, stage).data
    if data.source == "rl":
        return tuple([{"prompt": row["prompt"], "completion": row["answer"]} for row in rows]
                     for rows in load_rows(config))
    if data.source == "env":
        from engines.agentic.warm_start import random_move_rows

        section, seed = config.agentic, config.run.seed
        make = lambda n, s: random_move_rows(section.env, dict(section.env_options), n, s,  # noqa: E731
                                             section.max_turns, section.system_prompt)
        return make(section.warm_start_episodes, seed + 2), make(data.num_heldout, seed + 3)
    if data.source == "files":
        from engines.data.chat import load_records

        return load_records(data.train_path), load_records(data.heldout_path)
    from engines.data import synthetic

    make = synthetic.preference_task if stage == "dpo" else synthetic.sft_task
    seed = config.run.seed
    return make(data.num_train, seed=seed), make(data.num_heldout, seed=seed + 1_000_003)


def build_objective(config: Config, stage: str):
    """The loss of ``stage``: ``SFTObjective``, ``DPOObjective`` or ``DistillObjective``."""
    if stage == "sft":
        return SFTObjective()
    if stage == "dpo":
        dpo = config.dpo
        return DPOObjective(loss=dpo.loss, beta=dpo.beta, options=dict(dpo.options), sft_weight=dpo.sft_weight)
    distill = config.distill
    return DistillObjective(divergence=distill.divergence, options=dict(distill.options), weight=distill.weight,
                            temperature=distill.teacher.temperature, temperature_squared=distill.temperature_squared,
                            top_k=1)  # the cache always holds the top-k form (k = vocabulary for top_k 0)


def model_digest(path: str) -> str:
    """What a model is, for cache keys: the key in its folder's marker (a stage's output), else the sha256 of
    its weight files (a local folder), else its URI (a hub id)."""
    marker = store.read_json(store.join(path, store.MANIFEST)) or {}
    if "key" in marker:
        return marker["key"]
    fs, root = store.filesystem(path)
    if not fs.isdir(root):
        return path
    digest = hashlib.sha256()
    for file in sorted(fs.glob(f"{root}/*.safetensors")) + sorted(fs.glob(f"{root}/*.bin")):
        with fs.open(file, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def cache_manifest(config: Config, stage: str, digests: dict[str, str], scorer: str, rows_fingerprint: str) -> dict:
    """What a reference or teacher cache was made from: its key hashes the data, the scoring model, the
    tokenizer and the tokenization settings (and the teacher's k and temperature). ``digests``: the
    ``model_digest`` of the stage's input model (its tokenizer) and of ``scorer``, by path."""
    section = getattr(config, stage)
    manifest = {"stage": stage, "scorer": scorer, "scorer_digest": digests["scorer"],
                "tokenizer": digests["model"], "data": rows_fingerprint,
                "max_length": section.data.max_length, "dtype": config.model.dtype}
    if stage == "distill":
        teacher = section.teacher
        manifest.update(top_k=teacher.top_k, temperature=teacher.temperature)
    manifest["key"] = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
    return manifest


@flow(name="supervised-stage", persist_result=False)
def supervised_flow(config: Config, stage: str, model_path: str, tracker: RunTracker, key: str) -> str:
    """Train ``model_path`` with stage ``stage`` (sft, dpo or distill); returns its output folder
    (``stage_dir``), whose marker carries ``key``. Resumes from the stage's newest checkpoint."""
    section = getattr(config, stage)
    root, out = checkpoint_root(config, stage), stage_dir(config, stage)
    pad = load_tokenizer(model_path).pad_token_id
    rows = dict(zip(("train", "heldout"), stage_rows(config, stage)))
    encoded = {split: encode_split(config, stage, model_path, split, split_rows, tracker)
               for split, split_rows in rows.items()}
    placement = reserve_placement(config, {"trainer", *({"reference"} if stage != "sft" else set())})
    caches = score_splits(config, stage, model_path, rows, encoded, pad, placement) if stage != "sft" else {}
    trainer = start_trainer(config, stage, model_path, placement)
    latest = store.latest_checkpoint(root)
    state = restore({"policy": trainer}, latest[1]) if latest is not None else {"step": 0, "position": 0}
    objective = build_objective(config, stage)
    (train_ref, num_train), (heldout_ref, num_heldout) = encoded["train"], encoded["heldout"]

    def heldout_metrics() -> dict[str, float]:
        found = supervised_eval(trainer, stage, heldout_ref, caches.get("heldout"), num_heldout, pad, objective)
        return {_stage_metric(stage, k, "eval"): v for k, v in found.items()}

    heldout: dict[str, float] = {}
    progress = StageProgress(stage, section.steps, start=state["step"], keys=(f"{stage}/loss", f"{stage}/eval/loss"))
    with tracker.sent_on_error():
        if state["step"] == 0 and section.eval_every:  # the start, to measure the stage against
            tracker.log_step(f"{stage}_eval", 0, heldout_metrics())
        for step in range(state["step"] + 1, section.steps + 1):
            indices, position = take(num_train, state["position"], section.batch_size, seed=config.run.seed + 1)
            metrics = supervised_train(trainer, stage, train_ref, caches.get("train"), indices, pad, objective)
            metrics = {_stage_metric(stage, k): v for k, v in metrics.items()}
            if step == section.steps or (section.eval_every and step % section.eval_every == 0):
                heldout = heldout_metrics()
                metrics.update(heldout)
            tracker.log_step(stage, step, metrics, flush=False)
            progress.update(step, metrics)
            state = {"step": step, "position": position}
            if step % section.checkpoint_every == 0 and step < section.steps:
                tracker.flush()  # before the checkpoint claims these steps
                checkpoint({"policy": trainer}, root, step, {**state, "mlflow_run_id": tracker.run_id}, config.checkpoint.keep)
    progress.close()
    tracker.flush()
    save_model(trainer, out, section.steps, {**state, "stage": stage, "mlflow_run_id": tracker.run_id,
                                             "heldout": heldout}, key=key)
    stop_engine(trainer)
    placement.release()
    return out


def encode_split(config: Config, stage: str, model_path: str, split: str, rows: list[dict], tracker: RunTracker):
    """``(encoded_ref, count)`` of one split of the stage's rows; rows left out are logged and tagged on the
    MLflow run with their count and an example per reason; none left is an error."""
    data = getattr(config, stage).data
    form = "dpo" if stage == "dpo" else "sft_completion" if data.source == "env" else "sft"  # env: world-model loss
    ref, kept, rejected = encode_rows(form, model_path, quote(rows), getattr(config, stage).data.max_length)
    if kept == 0:
        raise ValueError(f"{stage}.data: no {split} row is usable ({rejected.summary()}); see engines/data/chat.py "
                         "for the row forms")
    if rejected.total:
        get_run_logger().warning("%s: %s of %d %s rows", stage, rejected.summary(), len(rows), split)
        tracker.client.set_tag(tracker.run_id, f"rollflow.{stage}.{split}_rejected", rejected.summary()[:5000])
    return ref, kept


def start_trainer(config: Config, stage: str, model_path: str, placement):
    """The stage's ``train.engine`` (ranks, LoRA and attention options of the config), at the distillation
    temperature for ``distill``; DPO's micro-batches hold ``micro_batch_size`` pairs. ``model.lora`` adapts
    every stage but a warm start (SFT before the main stage of kind rlvr, dpo, distill, onpolicy_distill),
    which trains all weights, as a tiny model built from scratch needs."""
    section = getattr(config, stage)
    options = {"attn_implementation": config.model.attn_implementation} if config.model.attn_implementation else {}
    if config.train.gradient_checkpointing:
        options["gradient_checkpointing"] = True
    warm_start = stage == "sft" and config.kind not in ("sft", "pipeline")  # before another kind's main stage
    if config.model.lora is not None and not warm_start:
        options["lora"] = config.model.lora.model_dump()
    return start_train_engine(
        config, "trainer", placement, run_name=config.run.name, reuse=False, model_path=model_path,
        optim=OptimSpec(**section.optim.model_dump(), total_steps=section.steps), dtype=config.model.dtype,
        seed=config.run.seed, torch_threads=config.run.torch_threads,
        micro_batch_size=section.micro_batch_size * (2 if stage == "dpo" else 1),
        temperature=config.distill.teacher.temperature if stage == "distill" else 1.0, packing=config.train.packing,
        share_prompts=stage == "dpo" and config.train.share_prompts, **options)  # a pair's rows share the prompt


def score_splits(config: Config, stage: str, model_path: str, rows: dict, encoded: dict, pad: int, placement) -> dict:
    """Each split's cache (a ref): the reference's summed log-probs of every pair (``dpo``) or the teacher's
    top-k at every answer token (``distill``), read from ``<run.dir>/cache/`` or computed once by a scorer
    engine started for it (after the tokenizers are checked to match, for a teacher)."""
    from flows.lineage import dataset_fingerprint

    section = getattr(config, stage)
    path = (section.reference or model_path) if stage == "dpo" else section.teacher.path
    if stage == "distill":
        from engines.models import check_vocabularies

        check_vocabularies(model_path, path)
    scorer = start_engine("teacher/torch" if stage == "distill" else "reference/torch", run_name=config.run.name,
                          role="teacher" if stage == "distill" else "reference", model_path=path,
                          dtype=config.model.dtype, torch_threads=config.run.torch_threads,
                          micro_batch_size=section.micro_batch_size, **placement.options("reference"))
    caches = {}
    digests = {"model": model_digest(model_path), "scorer": model_digest(path)}  # once: they may read every weight
    for split, split_rows in rows.items():
        manifest = cache_manifest(config, stage, digests, path, dataset_fingerprint(split_rows))
        uri = store.join(config.run.resolved_dir, "cache", f"{stage}-{split}-{manifest['key'][:16]}")
        if stage == "dpo":
            caches[split] = score_reference(scorer, encoded[split][0], pad, uri, manifest)
        else:
            caches[split] = score_teacher(scorer, encoded[split][0], pad, section.teacher.top_k,
                                          section.teacher.temperature, uri, manifest)
    stop_engine(scorer)  # the score tasks return once their caches exist
    return caches


def _stage_metric(stage: str, name: str, split: str = "") -> str:
    """``<stage>/[<split>/]<name>`` without repeating the stage: ``sft/nll``, ``dpo/rewards/chosen``,
    ``dpo/eval/rewards/accuracies``, ``distill/eval/ce``; the engine's ``train/…`` keep their last part."""
    name = name.removeprefix(f"{stage}/").removeprefix("train/")
    return "/".join(part for part in (stage, split, name) if part)
