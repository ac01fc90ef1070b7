"""The eval stage of a pipeline: held-out accuracy of the pipeline's final model on every RL domain, with
the rollout engine and rewards RL uses (``eval.temperature``, 0 = greedy), logged as ``eval/heldout_accuracy``
(and ``eval/<domain>/accuracy``) with a table of sample generations. Its output folder holds the figures
(``state.json``) and its done-marker."""

from __future__ import annotations

from prefect import flow

from configs.schema import Config
from engines import checkpoint_store as store
from engines.actors import start_engine
from flows.rlvr import RLEngines, eval_metrics, heldout_eval, rollout_engine_options
from flows.setup import domain_rewards, load_domains, reserve_placement, stage_dir
from flows.tracking import RunTracker


@flow(name="evaluate-stage", persist_result=False)
def evaluate_flow(config: Config, model_path: str, tracker: RunTracker, key: str) -> str:
    """Evaluate ``model_path``; returns the stage's output folder (``stage_dir(config, "eval")``)."""
    from engines.models import load_tokenizer, stop_token_ids

    domains = load_domains(config)
    placement = reserve_placement(config, {"rollout", "reward"})
    common = dict(run_name=config.run.name, model_path=model_path, dtype=config.model.dtype,
                  torch_threads=config.run.torch_threads)
    rollout = start_engine(f"rollout/{config.rollout.engine}", role="eval-rollout", **placement.options("rollout"),
                           **rollout_engine_options(config, common))
    worker = start_engine("reward/worker", run_name=config.run.name, role="eval-reward", rewards=domain_rewards(domains),
                          max_concurrency=2 * config.reward.concurrency, **placement.options("reward"))
    tokenizer = load_tokenizer(model_path)
    engines = RLEngines([rollout], None, None, None, [worker], None, tokenizer.pad_token_id,
                        stop_token_ids(tokenizer, config.rollout.stop), placement)
    try:
        accuracy, per_domain, samples = heldout_eval(config, engines, domains)
    finally:
        engines.stop()
    tracker.log_step("eval", 0, eval_metrics(accuracy, per_domain))
    tracker.log_samples("eval_final", samples[: config.tracking.num_samples])
    out = stage_dir(config, "eval")
    store.write_json(store.join(out, "state.json"), {"heldout_accuracy": {"final": accuracy, **per_domain},
                                                     "model": model_path, "mlflow_run_id": tracker.run_id})
    store.write_manifest(out, 0, ["state.json"], key=key)
    return model_path
