"""What every flow needs before its first task: Ray, the run directory, the data rows, the base model."""

from __future__ import annotations

import os
from pathlib import Path

import ray

from configs.placement import PlacementConfig
from configs.schema import Config
from engines import checkpoint_store as store
from engines.actors import NAMESPACE, joined_cluster, start_engine
from engines.placement import ROLES, Reservation, RoleSpec, plan_placement, reserve


# libgomp's idle OpenMP workers spin for GOMP_SPINCOUNT rounds after each parallel region before they sleep;
# its default, 300000, keeps a core busy for ~10 ms. The engines take turns on the same cores (generate,
# score, train, sync), so each would start beside the spin of the one before. 30000 (~1 ms) still covers
# the gaps between one engine call's ops; much lower, the threads sleep between ops and every op pays
# for waking them.
GOMP_SPINCOUNT = "30000"


def worker_env_vars(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of this job's Ray workers (the engines); a ``GOMP_SPINCOUNT`` set in ``environ`` wins."""
    environ = os.environ if environ is None else environ
    return {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
            "GOMP_SPINCOUNT": environ.get("GOMP_SPINCOUNT", GOMP_SPINCOUNT)}


def ensure_ray() -> None:
    """Join ``RAY_ADDRESS`` if set, else start a local Ray in this process."""
    if ray.is_initialized():
        return
    verbose = bool(os.environ.get("ROLLFLOW_VERBOSE"))
    if not os.environ.get("RAY_ADDRESS"):  # Ray nices its workers to 15; the engines are the job's main work
        os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(
        address=os.environ.get("RAY_ADDRESS") or None,
        namespace=NAMESPACE,
        include_dashboard=False,
        log_to_driver=verbose,
        configure_logging=verbose,
        runtime_env={"env_vars": worker_env_vars()},
    )


def reserve_placement(config: Config, roles: set[str]) -> Reservation:
    """The placement groups of ``roles``, those a stage starts (``placement``; none without GPUs or without
    the section: every engine then runs on CPU, one actor per role and per reward worker). The trainer and
    critic run ``train.ranks`` actors: one bundle each when they ask GPUs, one placement group together."""
    section = config.placement or PlacementConfig()
    actors = {"reward": config.reward.workers, "trainer": config.train.ranks, "critic": config.train.ranks}
    specs = {role: RoleSpec(actors.get(role, getattr(section, role).replicas), getattr(section, role).gpus)
             for role in ROLES if role in roles}
    return reserve(plan_placement(specs, section.colocate), config.run.name, section.timeout_s,
                   detached=joined_cluster())


def start_train_engine(config: Config, role: str, placement: Reservation, **kwargs):
    """The ``train.engine`` actor of ``role`` (trainer or critic) built from ``kwargs``: one actor, or for a
    sharded engine (``engines.backends.RANKED``) a ``RankGroup`` of ``train.ranks`` actors with the
    backend's options (``train.deepspeed``), rank i placed in bundle i of the role's placement group."""
    from engines.backends import is_ranked
    from engines.rank_group import start_rank_group

    kind = f"train/{config.train.engine}"
    if not is_ranked(kind):
        return start_engine(kind, role=role, **placement.options(role), **kwargs)
    if kind == "train/deepspeed":
        options = config.train.deepspeed
        kwargs.update(zero_stage=options.stage, offload_optimizer=options.offload_optimizer,
                      offload_params=options.offload_params)
    return start_rank_group(kind, role=role, world_size=config.train.ranks,
                            placement=[placement.options(role, i) for i in range(config.train.ranks)], **kwargs)


# Settings of the temporary server that ``start_prefect_server`` starts, by (service, field); a value the
# user set (environment or profile) wins. By default its task-run recorder writes each task-run event,
# three per task, in an INSERT of its own (batch size 1), and that server CPU is taken from the engines'
# cores. Batches of up to 200 flushed every second (events: 500, every 2 s) halve the server's CPU per
# task. Task runs reach the server's database up to a second later; when the server stops it writes the rest.
EMBEDDED_SERVER_SETTINGS = {
    ("task_run_recorder", "batch_size"): 200,
    ("task_run_recorder", "flush_interval"): 1.0,
    ("event_persister", "batch_size"): 500,
    ("event_persister", "flush_interval"): 2.0,
}


def start_prefect_server(timeout: int | None = None) -> None:
    """Prefect's temporary server when no ``PREFECT_API_URL`` names one (and ephemeral mode is on), with
    ``EMBEDDED_SERVER_SETTINGS`` and at the lowest CPU priority (``deprioritize``): it turns task-run
    events into database rows, work that can wait for the engines' idle moments. Safe to call again."""
    import prefect.settings
    from prefect.server.api.server import SubprocessASGIServer  # the instance Prefect's client reuses
    from prefect.settings import get_current_settings, temporary_settings

    settings = get_current_settings()
    if settings.api.url or not settings.server.ephemeral.enabled:
        return
    services = settings.server.services
    updates = {getattr(prefect.settings, f"PREFECT_SERVER_SERVICES_{service}_{field}".upper()): value
               for (service, field), value in EMBEDDED_SERVER_SETTINGS.items()
               if field not in getattr(services, service).model_fields_set}
    server = SubprocessASGIServer()
    with temporary_settings(updates=updates):  # context-local: the server process is started with them
        server.start(timeout=timeout)
    if server.server_process is not None and server.server_process.poll() is None:
        deprioritize(server.server_process.pid)


def deprioritize(pid: int) -> None:
    """Run every thread of process ``pid`` under ``SCHED_IDLE`` (Linux): it gets a core only when no
    normal thread wants one, and a waking normal thread preempts it at once. Nice 19 is not enough:
    a nice-19 thread still runs out its time slice, and an engine's two OpenMP threads then wait at
    every barrier for the one it displaced. Elsewhere (no ``SCHED_IDLE``) nice 19. Linux sets both
    per thread, so each existing thread is set; threads started later inherit it."""
    threads = os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else [str(pid)]
    for tid in map(int, threads):
        try:
            if hasattr(os, "SCHED_IDLE"):
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            else:
                os.setpriority(os.PRIO_PROCESS, tid, 19)
        except OSError:  # gone, or not ours: it runs at its own priority
            pass


def load_domains(config: Config) -> list:
    """The run's domains (``engines.data.domains.Domain``): those of ``data.domains``, or one domain
    ``default`` with ``reward.name`` and every prompt of the step."""
    from engines.data.domains import Domain, domain_counts, domain_seed

    data, reward = config.data, config.reward
    if data.source != "domains":
        train, heldout = _split_rows(data.source, data.arithmetic, data.train_path, data.heldout_path, config)
        return [Domain("default", reward.name, train, heldout, config.rollout.prompts_per_step,
                       sampler_seed=config.run.seed, timeout_s=reward.timeout_s)]
    counts = domain_counts([d.share for d in data.domains], config.rollout.prompts_per_step,
                           [d.name for d in data.domains])
    domains = []
    for spec, count in zip(data.domains, counts):
        train, heldout = _split_rows(spec.source, spec.arithmetic, spec.train_path, spec.heldout_path, config)
        domains.append(Domain(spec.name, spec.reward, train, heldout, count, sampler_seed=domain_seed(config.run.seed, spec.name),
                              reward_options=dict(spec.reward_options), timeout_s=spec.timeout_s))
    return domains


def domain_rewards(domains: list) -> tuple[str, ...]:
    """The rewards ``domains`` (``load_domains``) score with, sorted and once each."""
    return tuple(sorted({domain.reward for domain in domains}))


def _split_rows(source: str, arithmetic, train_path: str | None, heldout_path: str | None,
                config: Config) -> tuple[list[dict], list[dict]]:
    if source == "arithmetic":
        from engines.data.arithmetic import make_arithmetic_splits

        return make_arithmetic_splits(num_train=arithmetic.num_train, num_heldout=arithmetic.num_heldout,
                                      max_operand=arithmetic.max_operand, ops=tuple(arithmetic.ops), seed=config.run.seed)
    from engines.data.prompts import load_prompt_rows

    keys = dict(prompt_key=config.data.prompt_key, answer_key=config.data.answer_key)
    return load_prompt_rows(train_path, **keys), load_prompt_rows(heldout_path, **keys)


def load_rows(config: Config) -> tuple[list[dict], list[dict]]:
    """``(train_rows, heldout_rows)`` of every domain, each row ``{"prompt", "answer", …}``."""
    domains = load_domains(config)
    return [r for d in domains for r in d.train_rows], [r for d in domains for r in d.heldout_rows]


def check_prompt_lengths(config: Config, model_path: str, rows: list[dict]) -> None:
    """Raise ``ConfigError`` (one line) when the longest prompt of ``rows`` plus ``rollout.max_new_tokens``
    does not fit the model's positions (``ModelConfig.positions``). The schema checks max_new_tokens alone:
    a tiny model's tokenizer exists only once its base model is built. Prompts are tokenized as the rollout
    engine does (no special tokens); nothing is checked when the limit is unknown (a hub id), so no
    tokenizer is downloaded for it."""
    positions = config.model.positions()
    if positions is None or not rows:
        return
    from configs.loader import ConfigError
    from engines.models import load_tokenizer

    limit, key, where = positions
    prompts = [row["prompt"] for row in rows]
    lengths = [len(ids) for ids in load_tokenizer(model_path)(prompts, add_special_tokens=False)["input_ids"]]
    longest = max(range(len(prompts)), key=lengths.__getitem__)
    new_tokens = config.rollout.max_new_tokens
    if lengths[longest] + new_tokens > limit:
        raise ConfigError(f"rollout.max_new_tokens: the longest prompt ({prompts[longest][:40]!r}…) is "
                          f"{lengths[longest]} tokens; with max_new_tokens {new_tokens} that is "
                          f"{lengths[longest] + new_tokens}, over the model's {limit} positions ({where}); lower "
                          "rollout.max_new_tokens, shorten the longest prompts or use a model with more positions"
                          + ("" if key == "model.path" else f" (raise {key})"))


STAGE_OUTPUTS = {"rlvr": "final", "sft": "sft_model", "dpo": "dpo_model", "distill": "distill_model",
                 "onpolicy_distill": "onpolicy_distill_model", "agentic": "agentic_model", "eval": "eval"}
"""Each stage's output folder under the run directory."""


def stage_dir(config: Config, stage: str) -> str:
    """The output folder of ``stage`` (``STAGE_OUTPUTS``): its model, and its done-marker (``flows/stages.py``)."""
    return store.join(config.run.resolved_dir, STAGE_OUTPUTS[stage])


def checkpoint_root(config: Config, stage: str) -> str:
    """Where ``stage`` keeps its checkpoints (``<root>/checkpoints/step_N``): the run directory for RLVR,
    ``<run.dir>/stages/<stage>`` for the others."""
    run_dir = config.run.resolved_dir
    return run_dir if stage == "rlvr" else store.join(run_dir, "stages", stage)


def final_dir(config: Config) -> str:
    """The RL stage's output: the run's final model (``flows/stages.py``)."""
    return stage_dir(config, "rlvr")


def sft_dir(config: Config) -> str:
    """The SFT stage's output: the warm-started model."""
    return stage_dir(config, "sft")
