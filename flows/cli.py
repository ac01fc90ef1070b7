"""``rollflow`` command line: run or validate a config.

    rollflow run configs/quickstart.yaml run.dir=runs/demo run.seed=1
    rollflow validate configs/tiny.yaml rollout.group_size=4
    rollflow env build vllm
    rollflow rollout Corridor-v0 --policy random --episodes 3 --dump episodes.jsonl
"""

from __future__ import annotations

import os
import sys

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="RL post-training of LLMs on Prefect + Ray + MLflow.")

# Quiet, offline-friendly defaults; any of them can be set in the environment instead.
_ENV_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_LOGGING_LEVEL": "CRITICAL",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "RAY_DEDUP_LOGS": "0",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
}


def _load(config: str, overrides: list[str]):
    from configs.loader import ConfigError, load_config

    try:
        return load_config(config, overrides)
    except ConfigError as exc:
        raise _config_error(exc) from None


def _config_error(exc: Exception) -> typer.Exit:
    """Print ``exc`` as the one-line config error; the exit (code 2) to raise."""
    typer.echo(f"config error: {exc}", err=True)
    return typer.Exit(2)


def _start_services(cfg) -> None:
    """Start the embedded services side by side instead of one after another: Prefect's temporary server
    (when no PREFECT_API_URL) comes up in a thread while Ray starts and MLflow's sqlite schema is made here.
    The thread only waits on the server's subprocess, so no two threads import the same packages."""
    import threading

    import prefect.server.api.server  # noqa: F401  imported here, not in the thread
    from mlflow.tracking import MlflowClient

    from flows.setup import ensure_ray, start_prefect_server
    from flows.tracking import tracking_uri

    timeout = int(os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"])
    thread = threading.Thread(target=lambda: start_prefect_server(timeout), daemon=True)
    if not os.environ.get("PREFECT_API_URL"):
        thread.start()
    ensure_ray()
    MlflowClient(tracking_uri=tracking_uri(cfg.run.resolved_dir)).search_experiments(max_results=1)
    if thread.is_alive():
        thread.join()


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"


@app.command()
def run(config: str = typer.Argument(..., help="YAML preset (path or name under configs/)"),
        overrides: list[str] = typer.Argument(None, help="key=value overrides, e.g. run.dir=runs/x run.seed=1")) -> None:
    """Run a config to completion, or resume it from its run directory."""
    cfg = _load(config, overrides or [])
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    from configs.loader import ConfigError
    from flows.pipeline import finished_summary, is_finished, run_flow
    from flows.stages import check_rerun

    try:  # before Ray and Prefect start: a run directory this config cannot continue fails at once
        check_rerun(cfg)
        finished = is_finished(cfg)
    except ConfigError as exc:
        raise _config_error(exc) from None
    if finished:
        result = finished_summary(cfg)  # no services to start for a run that is done
    else:
        _start_services(cfg)
        result = run_flow(cfg)
    accuracy = result["heldout_accuracy"]
    if result["already_finished"]:
        typer.echo(f"run {cfg.run.name!r} already finished: {result['final_dir']}")
    typer.echo(f"final model: {result['final_dir']}  mlflow run: {result['mlflow_run_id']}", err=True)
    if result["heldout"]:  # a supervised last stage: its held-out loss and accuracies
        typer.echo("held-out " + " ".join(f"{k}={_fmt(v)}" for k, v in sorted(result["heldout"].items())))
    elif "final" in accuracy:  # an eval stage
        typer.echo(f"heldout_accuracy final={_fmt(accuracy['final'])}")
    else:
        steps = sorted(accuracy, key=int)
        label = "sft" if cfg.sft is not None else "start"
        typer.echo(f"heldout_accuracy {label}={_fmt(accuracy.get('0'))} rl={_fmt(accuracy[steps[-1]] if steps else None)}")


@app.command()
def validate(config: str = typer.Argument(...), overrides: list[str] = typer.Argument(None)) -> None:
    """Check a config and print it resolved."""
    from configs.loader import dump_config

    typer.echo(dump_config(_load(config, overrides or [])))


@app.command()
def deploy(prefect_file: str = typer.Option("infra/prefect/prefect.yaml", help="deployments to register"),
           work_pool: str = typer.Option("rollflow-process", help="process work pool the deployments use")) -> None:
    """Create the process work pool if missing and register every deployment of PREFECT_FILE (runs
    `prefect deploy --all` from the repository root). Needs PREFECT_API_URL (a Prefect server)."""
    import subprocess
    from pathlib import Path

    if not os.environ.get("PREFECT_API_URL"):
        typer.echo("set PREFECT_API_URL to a Prefect server (e.g. http://127.0.0.1:4200/api): deployments live there",
                   err=True)
        raise typer.Exit(2)
    root = Path(__file__).resolve().parents[1]
    prefect = [sys.executable, "-m", "prefect"]
    found = subprocess.run([*prefect, "work-pool", "inspect", work_pool], capture_output=True, text=True, cwd=root)
    if found.returncode != 0:
        subprocess.run([*prefect, "work-pool", "create", work_pool, "--type", "process"], check=True, cwd=root)
    result = subprocess.run([*prefect, "--no-prompt", "deploy", "--all", "--prefect-file", prefect_file], cwd=root)
    raise typer.Exit(result.returncode)


engines_app = typer.Typer(no_args_is_help=True, help="Engine actors kept on a persistent Ray cluster (RAY_ADDRESS).")
app.add_typer(engines_app, name="engines")


def _join_cluster() -> None:
    if not os.environ.get("RAY_ADDRESS"):
        typer.echo("set RAY_ADDRESS to the cluster (e.g. 127.0.0.1:6379): engines outlive runs only there", err=True)
        raise typer.Exit(2)
    from flows.setup import ensure_ray

    ensure_ray()


@engines_app.command("list")
def engines_list(run_name: str = typer.Argument("", help="only this run's engines")) -> None:
    """Live engine actors: <run>/<role>#<fingerprint>."""
    _join_cluster()
    from engines.actors import run_actor_names

    for name in run_actor_names(run_name or None):
        typer.echo(name)


@engines_app.command("stop")
def engines_stop(run_name: str = typer.Argument(..., help="run whose engines to stop")) -> None:
    """Stop a run's engine actors and free their memory and GPUs (a later run of it loads the models again)."""
    _join_cluster()
    from engines.actors import run_actor_names, stop_named
    from engines.placement import release_run

    names = run_actor_names(run_name)
    for name in names:
        stop_named(name)
    release_run(run_name)  # the placement groups that held their GPUs
    typer.echo(f"stopped {len(names)} engine(s) of {run_name!r}")


env_app = typer.Typer(no_args_is_help=True, help="Engines' own virtualenvs (vLLM pins other versions than the trainer).")
app.add_typer(env_app, name="env")


@env_app.command("build")
def env_build(name: str = typer.Argument(..., help="the engine env to build: vllm"),
              variant: str = typer.Option("", help="cpu or cuda; default: cuda where torch is a CUDA build"),
              force: bool = typer.Option(False, help="rebuild even if the env exists")) -> None:
    """Build (or find) an engine's venv from its pinned requirements, with the driver's torch, Ray and numpy."""
    from engines.envs import ENVS, EnvError, build_env, check_env

    if name not in ENVS:
        typer.echo(f"unknown env {name!r}; known: {', '.join(sorted(ENVS))}", err=True)
        raise typer.Exit(2)
    try:
        folder = build_env(name, variant or None, echo=lambda line: typer.echo(line, err=True), force=force)
        check_env(name, str(folder / "bin" / "python"))
    except EnvError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(str(folder / "bin" / "python"))


@app.command("rollout")
def rollout(env_id: str = typer.Argument(..., help="environment id, e.g. Corridor-v0 (engines.environments)"),
            policy: str = typer.Option("random", help="random, scripted, human or hf:PATH (a local HF model)"),
            episodes: int = typer.Option(3, min=1, help="episodes to run, one after another"),
            seed: int = typer.Option(0, help="environment seed of the first episode (then seed+1, …)"),
            option: list[str] = typer.Option([], "--option", "-o", help="environment option key=value (YAML value)"),
            max_turns: int = typer.Option(8, min=1), max_tokens: int = typer.Option(8, min=1, help="tokens per turn"),
            max_context: int = typer.Option(1024, min=2, help="tokens of a whole trajectory"),
            temperature: float = typer.Option(1.0, min=0.0, help="sampling temperature (hf: policies)"),
            tokenizer: str = typer.Option("", help="tokenizer folder for text policies; default: one trained on the env"),
            system_prompt: bool = typer.Option(False, help="the env's instructions as a system message"),
            dump: str = typer.Option("", help="write the episodes to this jsonl file"),
            replay: str = typer.Option("", help="replay a jsonl dump (its actions, fresh envs) and report differences"),
            color: bool = typer.Option(True, help="model tokens in green; --no-color: between ⟦ ⟧")) -> None:
    """Run episodes in the terminal, without Ray or Prefect, showing the model's and the environment's tokens."""
    import yaml

    from engines import environments
    from engines.agentic import local
    from engines.agentic.rollout import RolloutSettings
    from engines.models import load_tokenizer

    options = {}
    for item in option:
        key, sep, value = item.partition("=")
        if not sep:
            raise _config_error(ValueError(f"--option {item!r}: expected key=value"))
        options[key] = yaml.safe_load(value)
    try:
        environments.make(env_id, **options).close()
    except (KeyError, TypeError, ValueError, ImportError) as exc:
        raise _config_error(exc) from None
    model_path = policy[3:] if policy.startswith("hf:") else tokenizer
    tok = load_tokenizer(model_path) if model_path else local.debug_tokenizer(env_id, options, system_prompt)
    settings = RolloutSettings(max_turns=max_turns, max_tokens_per_turn=max_tokens, max_context=max_context,
                               temperature=temperature, stop_token_ids=(tok.eos_token_id,))
    if replay:
        replayed, differences = local.replay(local.load(replay), tok, settings, options, system_prompt)
        for episode in replayed:
            typer.echo(local.render(episode, tok, color))
        typer.echo(f"replayed {len(replayed)} episode(s): " + ("identical" if not differences else
                                                                f"{len(differences)} difference(s)"))
        for line in differences:
            typer.echo(f"  {line}")
        raise typer.Exit(1 if differences else 0)
    try:
        chosen = local.build_policy(policy, tok, settings)
    except ValueError as exc:
        raise _config_error(exc) from None
    done = local.run_local(env_id, options, chosen, tok, settings, episodes, seed, system_prompt)
    for episode in done:
        typer.echo(local.render(episode, tok, color))
    successes = sum(e.success for e in done)
    typer.echo(f"{len(done)} episode(s): success {successes}/{len(done)}, mean return "
               f"{sum(e.episode_return for e in done) / len(done):.3f}")
    if dump:
        local.dump(done, dump)
        typer.echo(f"wrote {dump}")


def main() -> None:  # python -m flows.cli
    app()


if __name__ == "__main__":
    sys.exit(main())
