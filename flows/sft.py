"""Supervised fine-tuning on ``prompt → answer`` pairs: the warm start before RL.

Next-token cross-entropy on the answer (+EOS) tokens only, AdamW, one Prefect task per step.
The stage (``flows/stages.py``) is short and deterministic: it is done once ``<run>/sft_model/MANIFEST.json``
exists with its key; an interrupted stage reruns from its start and reaches the same weights.

Launch: ``rollflow run configs/quickstart.yaml`` runs it before RL when ``sft:`` is set; the ``sft``
deployment (``flows/deployments.py``) runs it alone.
"""

from __future__ import annotations

from prefect import flow

from configs.schema import Config
from flows.setup import load_rows, reserve_placement, sft_dir
from flows.stages import stage_key
from flows.progress import StageProgress
from flows.tracking import RunTracker
from engines.actors import start_engine, stop_engine
from engines.algorithms.objective import SFTObjective
from engines.data.sampler import take
from engines.training.torch import OptimSpec
from tasks.checkpoint import save_model
from tasks.train import sft_train


@flow(name="sft", persist_result=False)
def sft_flow(config: Config, model_path: str, tracking_uri: str, mlflow_run_id: str) -> str:
    """Train ``model_path`` with SFT on the training rows; returns the folder of the tuned HF model
    (``sft_dir``). Always trains: whether the stage is done is the pipeline's question."""
    sft = config.sft
    train_rows, _ = load_rows(config)
    out = sft_dir(config)
    tracker = RunTracker(tracking_uri, mlflow_run_id)
    optim = OptimSpec(**sft.optim.model_dump(), total_steps=sft.steps)
    options = {"attn_implementation": config.model.attn_implementation} if config.model.attn_implementation else {}
    if config.train.gradient_checkpointing:
        options["gradient_checkpointing"] = True
    placement = reserve_placement(config, {"trainer"})  # the trainer's GPUs of ``placement``
    trainer = start_engine("train/torch", run_name=config.run.name, role="sft-trainer", reuse=False, model_path=model_path,
                           optim=optim, dtype=config.model.dtype, seed=config.run.seed,
                           torch_threads=config.run.torch_threads, micro_batch_size=sft.micro_batch_size,
                           **placement.options("trainer"), **options)
    objective = SFTObjective()
    progress = StageProgress("sft", sft.steps, keys=("sft/nll",))
    position = 0
    for step in range(1, sft.steps + 1):
        indices, position = take(len(train_rows), position, sft.batch_size, seed=config.run.seed + 1)
        rows = [train_rows[i] for i in indices]
        metrics = sft_train(trainer, model_path, [r["prompt"] for r in rows], [r["answer"] for r in rows], objective)
        # the RL stage logs train/… and perf/… at its own step numbers: keep SFT's apart under sft/…
        metrics = {k if k.startswith("sft/") else "sft/" + k.replace("/", "_"): v for k, v in metrics.items()}
        tracker.log_step("sft", step, metrics, flush=step % 10 == 0)
        progress.update(step, metrics)
    progress.close()
    tracker.flush()
    save_model(trainer, out, sft.steps, {"mlflow_run_id": mlflow_run_id, "stage": "sft", "step": sft.steps},
               key=stage_key(config, "sft", model_path))
    stop_engine(trainer)
    placement.release()
    return out
