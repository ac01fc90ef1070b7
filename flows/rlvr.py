"""RLVR: sample G completions per prompt, reward them with a verifiable checker, turn rewards into
advantages with the configured estimator, and train on each batch with PPO's inner loop
(``train.ppo_epochs`` passes of ``train.mini_batches`` optimizer steps; 1 × 1 is one step per batch).

Variants by config (``configs/algorithms/*.yaml``): GRPO (Shao et al. 2024), Dr.GRPO, DAPO (clip-higher,
dynamic sampling, overlong shaping), GSPO, RLOO, REINFORCE++ (+baseline), Lite PPO, RAFT++, TOPR, and
PPO with a critic (``advantage: gae``). KL to a frozen reference as a loss term or a reward penalty,
fixed or adaptive. Every step: generate → score (→ refill, dynamic sampling) → compute_advantages
(reference / old-logprob / critic scoring) → train (critic, then policy) → sync_weights (→ evaluate)
(→ checkpoint).

Launch: ``rollflow run configs/tiny.yaml`` (RL only), ``rollflow run configs/algorithms/ppo.yaml``, or
``rollflow run configs/quickstart.yaml`` (SFT + RL). Rerunning the same command resumes from the newest
complete checkpoint in ``run.dir`` (policy, critic, optimizer states, data position, KL coefficient,
running reward statistics). ``rl_step`` is the step body; tests and ``bench/algorithms.py`` run this
flow itself.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

from prefect import flow
from prefect.utilities.annotations import quote  # large task arguments: Prefect need not walk them (no futures inside)

from configs.placement import PlacementConfig
from configs.schema import Config
from flows.agentic import agentic_eval, episode_batch, group_specs, start_env_workers
from flows.asynchrony import OneStepAhead, pending_files
from flows.sampling import call_sampling, sample_step, score_spec
from flows.setup import (checkpoint_root, domain_rewards, load_domains, reserve_placement, stage_dir,
                         start_train_engine)
from flows.stages import stage_key
from flows.progress import StageProgress
from flows.tracking import RunTracker
from engines import checkpoint_store as store
from engines.actors import describe, run_actor_names, start_engine, stop_engine, stop_named
from engines.algorithms.kl import adaptive_kl_coef
from engines.algorithms.objective import PolicyObjective, ValueObjective
from engines.algorithms.advantages import GROUP_ESTIMATORS
from engines.algorithms.shaping import RunningMoments, ShapingSpec
from engines.placement import Reservation
from engines.rewards.failures import RewardFailureMonitor, failures_by_domain
from engines.batches import AdvantageSpec
from engines.training.torch import OptimSpec
from engines.training.updates import UpdateSpec
from engines.types import SamplingParams
from tasks.advantages import compute_advantages
from tasks.checkpoint import checkpoint, restore, save_model
from tasks.common import timed
from tasks.episode_stream import EpisodeStream
from tasks.evaluate import evaluate
from tasks.pending_batch import PENDING_FILE, load_pending
from tasks.rollout_stream import RolloutStream, calls_share_batches, stream_calls
from tasks.score import ScoredBatch, rollout_samples
from tasks.sync import set_memory_phase, sync_weights
from tasks.train import train


@dataclass
class RLEngines:
    rollouts: list  # one per replica (placement.rollout.replicas); every sync reaches all of them
    trainer: object
    reference: object | None
    critic: object | None
    reward_workers: list
    judge: object | None
    pad_token_id: int
    stop_token_ids: tuple[int, ...]
    placement: Reservation | None = None
    colocated: tuple[str, ...] = ()  # training roles sharing the rollout engines' GPUs: they take turns
    teachers: dict = field(default_factory=dict)  # on-policy distillation: teacher name -> its scoring engine
    env_workers: list = field(default_factory=list)  # agentic RL: the environment workers
    start_rollout: Callable[[int], object] | None = None  # (re)starts rollout replica i, as at the run's start

    def replace_rollout(self, replica: int, sync: Callable[[list, int], None] | None = None, version: int = 0) -> None:
        """A new engine for rollout replica ``replica`` (its actor died); ``sync(engines, version)`` then gives
        it the trainer's weights, labelled ``version``, when given."""
        self.rollouts[replica] = self.start_rollout(replica)
        if sync is not None:
            sync([self.rollouts[replica]], version)

    @property
    def swapped(self) -> list:
        """The training engines that offload while the colocated rollout engines generate."""
        roles = {"trainer": self.trainer, "reference": self.reference, "critic": self.critic}
        return [roles[role] for role in self.colocated if roles.get(role) is not None]

    def memory_phase(self, phase: str) -> dict[str, float]:
        """``generate``, ``train`` or ``sync`` (``tasks.sync.set_memory_phase``); returns the memory each side
        holds then. Nothing (and no figures) without colocation."""
        return set_memory_phase(self.rollouts, self.swapped, phase) if self.swapped else {}

    @property
    def reward_worker(self):
        """The worker that also builds advantage batches and joins rollouts."""
        return self.reward_workers[0]

    @property
    def train_engines(self) -> dict:
        """The engines with state to checkpoint, by role."""
        return {"policy": self.trainer, **({"critic": self.critic} if self.critic is not None else {})}

    def stop(self) -> None:
        for handle in (*self.rollouts, self.trainer, self.reference, self.critic, self.judge, *self.reward_workers,
                       *self.teachers.values(), *self.env_workers):
            if handle is not None:
                stop_engine(handle)
        if self.placement is not None:
            self.placement.release()


def start_rl_engines(config: Config, model_path: str, restoring: bool, domains: list,
                     stage: str = "rlvr") -> RLEngines:
    """Rollout engine, trainer, reward workers (warming up the rewards of ``domains``, ``load_domains``,
    as they start), a judge engine (when a domain scores with ``judge``), a frozen reference (when
    ``kl.coef > 0``), a critic (when ``advantage: gae``) and, for ``stage`` ``onpolicy_distill``, a teacher
    per ``onpolicy_distill.teachers`` entry, as named Ray actors; live ones of this run
    with the same settings are reattached (the trainer and critic only when ``restoring`` from a
    checkpoint, which resets them). Each is placed by ``placement`` (``reserve_placement``)."""
    from engines.models import check_vocabularies, load_tokenizer, stop_token_ids

    # options passed only when set: backends without them (vLLM) and the fingerprints of live actors stay as they were
    attn = {"attn_implementation": config.model.attn_implementation} if config.model.attn_implementation else {}
    common = dict(run_name=config.run.name, model_path=model_path, dtype=config.model.dtype,
                  torch_threads=config.run.torch_threads, **attn)
    trainable = dict(common, reuse=restoring)
    if config.train.gradient_checkpointing:
        trainable["gradient_checkpointing"] = True
    temperature = config.rollout.temperature
    judge_path = judge_model_path(domains, model_path)
    # with LoRA the trainer's frozen base is the KL reference (lora_reference): no reference engine
    teacher_routes = config.onpolicy_distill.teachers if stage == "onpolicy_distill" else []
    optional = {"reference": config.algorithm.kl.coef > 0 and config.model.lora is None,
                "critic": config.algorithm.advantage == "gae",
                "judge": judge_path is not None}
    check_teacher_placement(config, len(teacher_routes), optional["reference"])
    for route in teacher_routes:  # before any engine starts: a teacher must score the student's token ids
        check_vocabularies(model_path, route.path)
    placed = {"rollout", "trainer", "reward", *(role for role, on in optional.items() if on)}
    placement = reserve_placement(config, placed | ({"reference"} if teacher_routes else set()))  # teachers: like the reference
    where = placement.options
    optim = OptimSpec(**config.train.optim.model_dump(), total_steps=optimizer_steps(config, "policy"))
    roles = rollout_roles((config.placement or PlacementConfig()).rollout.replicas)
    for name in run_actor_names(config.run.name):  # replicas of an earlier placement with more of them
        role = name.split("/", 1)[1].split("#")[0]
        if role.startswith("rollout") and role not in roles:
            stop_named(name)
    # partial rollouts: generation on threads of its own (one per call in flight for vLLM, whose calls share
    # its batches), so weight updates land between its decoding steps
    threads = stream_calls(config)[0] if calls_share_batches(config) else 1
    groups = {"concurrency_groups": {"generate": threads}} if config.async_.partial_rollouts else {}

    def start_rollout(i: int):
        return start_engine(f"rollout/{config.rollout.engine}", role=roles[i], **where("rollout", i), **groups,
                            **rollout_engine_options(config, common))

    rollouts = [start_rollout(i) for i in range(len(roles))]
    trainer = start_train_engine(config, "trainer", placement, optim=optim, seed=config.run.seed,
                                 micro_batch_size=config.train.micro_batch_size, temperature=temperature,
                                 packing=config.train.packing, share_prompts=config.train.share_prompts,
                                 **({"lora": config.model.lora.model_dump()} if config.model.lora else {}), **trainable)
    reference = critic = None
    if optional["reference"]:
        reference = start_engine("reference/torch", role="reference", micro_batch_size=config.train.micro_batch_size,
                                 temperature=temperature, packing=config.train.packing,
                                 share_prompts=config.train.share_prompts, **where("reference"), **common)
    if config.algorithm.advantage == "gae":
        critic_optim = OptimSpec(**config.algorithm.critic.optim.model_dump(), total_steps=optimizer_steps(config, "critic"))
        critic = start_train_engine(config, "critic", placement, optim=critic_optim, seed=config.run.seed,
                                    micro_batch_size=config.train.micro_batch_size, head="value", **trainable)
    # Threaded actors: a worker takes several chunks at once; its reward pool bounds the calls in flight.
    reward_workers = [start_engine("reward/worker", run_name=config.run.name, role=f"reward-{i}",
                                   max_concurrency=2 * config.reward.concurrency, rewards=domain_rewards(domains),
                                   **where("reward", i))
                      for i in range(config.reward.workers)]
    # A teacher scores the sampled tokens at temperature 1 (``rollout_logprobs``), whatever the sampler's.
    teachers = {route.name: start_engine("teacher/torch", role=f"teacher-{route.name}", run_name=config.run.name,
                                         model_path=route.path, dtype=config.model.dtype,
                                         torch_threads=config.run.torch_threads,
                                         micro_batch_size=config.train.micro_batch_size, **attn, **where("reference"))
                for route in teacher_routes}
    judge = None
    if judge_path is not None:  # the LLM-as-judge reward's own inference engine
        judge = start_engine("rollout/hf", role="judge", run_name=config.run.name, model_path=judge_path,
                             dtype=config.model.dtype, torch_threads=config.run.torch_threads, **attn, **where("judge"))
    tokenizer = load_tokenizer(model_path)
    stop_ids = stop_token_ids(tokenizer, config.rollout.stop)
    env_workers = start_env_workers(config, model_path, stop_ids) if stage == "agentic" else []
    return RLEngines(rollouts, trainer, reference, critic, reward_workers, judge, tokenizer.pad_token_id,
                     stop_ids, placement, colocated_with_rollout(config), teachers, env_workers, start_rollout)


def check_teacher_placement(config: Config, teachers: int, reference: bool) -> None:
    """Teachers take the reference's slot of ``placement`` (its GPUs, colocation): with GPUs asked for it,
    that slot holds one scorer, so one teacher and no reference engine."""
    section = config.placement
    if teachers and section is not None and section.reference.gpus > 0 and teachers + reference > 1:
        raise ValueError(f"placement.reference.gpus: the reference slot holds one engine, but {teachers} teacher(s)"
                         f"{' and the KL reference' if reference else ''} would share it; use one teacher with "
                         "algorithm.kl.coef=0, or set placement.reference.gpus=0 (CPU)")


def lora_reference(config: Config) -> bool:
    """Whether the KL reference is the LoRA trainer's frozen base (adapter disabled) rather than an engine."""
    return config.algorithm.kl.coef > 0 and config.model.lora is not None


def colocated_with_rollout(config: Config) -> tuple[str, ...]:
    """The training roles (trainer, reference, critic) in the rollout engines' ``placement.colocate`` group."""
    groups = config.placement.colocate if config.placement is not None else []
    group = next((g for g in groups if "rollout" in g), [])
    return tuple(role for role in ("trainer", "reference", "critic") if role in group)


def rollout_engine_options(config: Config, common: dict) -> dict:
    """Constructor keywords of the rollout backend: ``common`` (the HF engine's), or for vLLM its
    ``rollout.vllm`` options and the run seed instead of the attention implementation (vLLM picks its own),
    the LoRA rank it serves when ``model.lora`` is set, and whether updates land during generation."""
    if config.rollout.engine != "vllm":
        return common
    options = {k: v for k, v in common.items() if k != "attn_implementation"}
    lora = {"max_lora_rank": config.model.lora.r} if config.model.lora is not None else {}
    partial = {"partial_rollouts": True} if config.async_.partial_rollouts else {}
    return {**options, **config.rollout.vllm.model_dump(), "seed": config.run.seed, **lora, **partial}


def rollout_roles(replicas: int) -> list[str]:
    """Role names of the rollout replicas: ``rollout`` alone, else ``rollout-0``, ``rollout-1``, …"""
    return ["rollout"] if replicas == 1 else [f"rollout-{i}" for i in range(replicas)]


def optimizer_steps(config: Config, role: str) -> int:
    """Optimizer steps of the whole run for ``role`` (policy or critic): what its LR schedule spans."""
    inner_loop = update_spec(config, 0, role)
    return config.train.steps * inner_loop.mini_batches * inner_loop.epochs


def judge_model_path(domains: list, model_path: str) -> str | None:
    """The model of the run's judge engine: the ``reward_options.model_path`` of its ``judge`` domains
    (default: ``model_path``, the policy's own), or None without one. One judge model per run."""
    judges = {d.reward_options.get("model_path") or model_path for d in domains if d.reward == "judge"}
    if len(judges) > 1:
        raise ValueError(f"judge domains name different models {sorted(judges)}; use one")
    return next(iter(judges), None)


def record_engines(run_dir: str, engines: RLEngines) -> None:
    """``<run.dir>/engines.json``: actor id, pid and node of each engine of the current attempt."""
    roles = {**dict(zip(rollout_roles(len(engines.rollouts)), engines.rollouts)), "trainer": engines.trainer, "reference": engines.reference,
             "critic": engines.critic, "judge": engines.judge, "reward": engines.reward_worker,
             **{f"reward-{i}": w for i, w in enumerate(engines.reward_workers[1:], start=1)},
             **{f"teacher-{name}": handle for name, handle in engines.teachers.items()},
             **{f"env-{i}": handle for i, handle in enumerate(engines.env_workers)}}
    store.write_json(store.join(run_dir, "engines.json"),
                     {role: describe(handle) for role, handle in roles.items() if handle is not None})


def build_objective(config: Config) -> PolicyObjective:
    """The policy loss of ``algorithm``: loss, aggregation, KL loss term (mode ``loss``), entropy bonus."""
    alg = config.algorithm
    agg_options = {"norm": alg.agg_norm or config.rollout.max_new_tokens} if alg.agg == "seq-mean-token-sum-norm" else {}
    return PolicyObjective(policy_loss=alg.policy_loss, agg=alg.agg, loss_options=dict(alg.loss_options),
                           agg_options=agg_options, kl_coef=alg.kl.coef if alg.kl.mode == "loss" else 0.0,
                           kl_estimator=alg.kl.estimator, entropy_coef=alg.entropy_coef)


def build_advantage_spec(config: Config, pad_token_id: int) -> AdvantageSpec:
    """Estimator, shaping, reward-KL and off-policy correction settings of ``algorithm`` for the reward worker."""
    alg = config.algorithm
    shaping = ShapingSpec(**alg.shaping.model_dump(), max_length=config.rollout.max_new_tokens)
    return AdvantageSpec(alg.advantage, pad_token_id, dict(alg.advantage_options), shaping,
                         kl_estimator=alg.kl.estimator, kl_in_reward=alg.kl.mode == "reward",
                         correction=alg.correction, correction_options=dict(alg.correction_options))


def update_spec(config: Config, step: int, role: str = "policy") -> UpdateSpec:
    """PPO's inner loop for ``role`` (policy or critic) at ``step``: its mini-batches and epochs, whole
    groups for a group estimator, and a row order seeded by the run seed, the step and the role (so a
    resumed run trains on the same mini-batches as an uninterrupted one)."""
    source = config.train if role == "policy" else config.algorithm.critic
    seed = (config.run.seed * 1_000_003 + step) * 2 + (role != "policy")
    return UpdateSpec(mini_batches=source.mini_batches, epochs=source.ppo_epochs, seed=seed,
                      keep_groups=config.algorithm.advantage in GROUP_ESTIMATORS)


@dataclass
class RLState:
    """What an RL run carries from step to step; checkpointed as JSON (``state.json``) and returned."""

    mlflow_run_id: str
    kl_coef: float  # the adaptive controller moves it
    step: int = 0
    domain_positions: dict[str, int] = field(default_factory=dict)  # prompts drawn per domain
    heldout_accuracy: dict[str, float] = field(default_factory=dict)  # by step, as a string
    reward_moments: RunningMoments = field(default_factory=RunningMoments)  # reward_norm: running
    reward_failures: dict[str, int] = field(default_factory=dict)  # consecutive failing steps per domain
    resumed_from: list[int] = field(default_factory=list)  # the step each later attempt started from
    weights_version: int = 0  # the policy's: the last step it trained (the version each sync sends)
    untrained_groups: int = 0  # async.mode full: groups drawn, not trained when the checkpoint was taken
    discarded_groups: int = 0  # async.mode full: such groups of the checkpoints resumed from (lost, counted)

    @property
    def data_position(self) -> int:
        """Prompts drawn so far, all domains."""
        return sum(self.domain_positions.values())

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "data_position": self.data_position}

    @classmethod
    def from_json(cls, data: dict) -> "RLState":
        """The state a checkpoint saved; one from before domains keeps its position as domain ``default``."""
        known = {f.name for f in dataclasses.fields(cls)}
        state = cls(**{k: v for k, v in data.items() if k in known})
        state.reward_moments = RunningMoments(**data.get("reward_moments", {}))
        if not state.domain_positions and data.get("data_position"):
            state.domain_positions = {"default": data["data_position"]}
        if "weights_version" not in data:  # saved before versions were kept: the version its resume synced
            state.weights_version = state.step
        return state


def rl_step(cfg: Config, engines: RLEngines, domains: list, state: RLState, step: int, *,
            reward_failures: RewardFailureMonitor, ahead: OneStepAhead | None = None,
            stream: RolloutStream | EpisodeStream | None = None) -> tuple[ScoredBatch, dict[str, float]]:
    """One RL step: generate → score (→ refill) → compute_advantages → train (critic, then policy) →
    sync_weights, and the adaptive KL controller; advances ``state`` and returns the batch and metrics.

    With ``ahead`` (``async.mode: one_step``) the batch was generated during the previous step's training;
    taking it syncs the trainer's weights to the rollout engines and starts the next batch, so this step
    ends without a sync. With ``stream`` (``async.mode: full``) the batch is the first ``prompts_per_step``
    groups (of prompts, or of episodes) the continuous rollout finished; dead rollout replicas are replaced
    before the sync."""
    alg = cfg.algorithm
    sync = partial(push_weights, cfg, engines)
    memory = engines.memory_phase("generate")
    if ahead is not None:
        scored = ahead.take(step, state.domain_positions, state.weights_version)
    elif stream is not None:
        scored, stats = stream.next_batch(step, state.weights_version,
                                          lambda replica: engines.replace_rollout(replica, sync, state.weights_version))
        reward_failures.update(step, failures_by_domain(stats))  # warns; raises past reward.failure_patience
    else:
        scored = sample_step(cfg, engines, domains, state.domain_positions, step, reward_failures)
    memory.update(engines.memory_phase("train"))
    metrics = scored.metrics
    with timed(metrics, "time/advantages"):
        batch_ref, advantage_metrics, moments = compute_advantages(
            engines.reward_worker, scored.rollouts_ref, scored.rewards_ref, quote(scored.group_ids),
            build_advantage_spec(cfg, engines.pad_token_id), reference=engines.reference,
            trainer=engines.trainer if alg.old_logprobs == "trainer" else None, critic=engines.critic,
            kl_coef=state.kl_coef, moments=state.reward_moments,
            base_reference=engines.trainer if lora_reference(cfg) else None, agentic=scored.agentic,
            policy_version=state.weights_version, max_version_lag=max_version_lag(cfg),
            **(teacher_scoring(cfg, engines, scored) if engines.teachers else {}))
    metrics.update(advantage_metrics)
    if engines.critic is not None:
        with timed(metrics, "time/train_critic"):
            metrics.update(train(engines.critic, batch_ref, ValueObjective(clip_range=alg.critic.clip_range),
                                 update_spec(cfg, step, "critic")))
    policy_trains = engines.critic is None or step > alg.critic.warmup_steps  # PPO's critic warm-up: critic alone
    if policy_trains:
        objective = build_objective(cfg)
        if objective.kl_coef:
            objective = dataclasses.replace(objective, kl_coef=state.kl_coef)
        with timed(metrics, "time/train"):
            metrics.update(train(engines.trainer, batch_ref, objective, update_spec(cfg, step)))
        if metrics.get("offpolicy/version_lag"):  # older weights sampled the batch: the drift is the lag, not the sync's
            for key in ("sync/logprob_drift_max", "sync/logprob_drift_mean"):
                metrics.pop(key, None)
    memory.update(engines.memory_phase("sync"))  # the trainer offloads, the rollout engines wake: sync, evaluation
    metrics.update(memory)
    if policy_trains:
        state.weights_version = step
        if ahead is None:
            with timed(metrics, "time/sync_weights"):
                if stream is not None:  # a dead replica gets a new engine, and the sync its weights
                    stream.sync(sync, step, engines.replace_rollout)
                else:
                    sync(engines.rollouts, step)
    if alg.kl.controller == "adaptive":
        state.kl_coef = adaptive_kl_coef(coef=state.kl_coef, observed_kl=advantage_metrics["kl/seq_mean"],
                                         target_kl=alg.kl.target, horizon=alg.kl.horizon,
                                         num_samples=len(scored.group_ids))
        metrics["kl/coef"] = state.kl_coef
    state.step, state.domain_positions, state.reward_moments = step, scored.positions, moments
    state.reward_failures = reward_failures.state()
    return scored, metrics


def push_weights(cfg: Config, engines: RLEngines, targets: list, version: int) -> None:
    """The trainer's weights, labelled ``version``, to the rollout engines ``targets`` (``tasks.sync``)."""
    sync_weights(engines.trainer, targets, version, cfg.sync.bucket_mb, adapter=cfg.model.lora is not None)


def max_version_lag(cfg: Config) -> int:
    """The most weight versions a batch may be behind the trainer in ``async.mode``."""
    return {"off": 0, "one_step": 1, "full": cfg.async_.max_staleness}[cfg.async_.mode]


def teacher_scoring(cfg: Config, engines: RLEngines, scored: ScoredBatch) -> dict:
    """``compute_advantages``' on-policy distillation keywords: each teacher with the rows the ``route_key``
    column sends it (``onpolicy.route_rows``), λ, whether the reward advantage is left out, and the row
    groups of ``teacher_kl/<domain>`` (several domains) and ``teacher_kl/<teacher>`` (several teachers)."""
    from engines.algorithms.onpolicy import route_rows

    section = cfg.onpolicy_distill
    if section.route_key not in scored.columns:
        raise ValueError(f"onpolicy_distill.route_key {section.route_key!r} is no column of the data; columns: "
                         f"{', '.join(sorted(scored.columns))}")
    routes = route_rows(scored.columns[section.route_key], [(t.name, t.values) for t in section.teachers],
                        section.route_key)
    domains = scored.columns["domain"]
    groups = {name: [i for i, d in enumerate(domains) if d == name] for name in dict.fromkeys(domains)} \
        if len(cfg.data.domains) > 1 else {}
    groups.update(routes if len(routes) > 1 else {})
    return {"teachers": [(engines.teachers[name], rows) for name, rows in routes.items()],
            "distill": {"teacher_coef": section.coef, "distill_only": not section.rewards,
                        "teacher_kl_groups": groups}}


def heldout_eval(config: Config, engines: RLEngines, domains: list) -> tuple[float, dict[str, float], list[dict]]:
    """Held-out accuracy over every domain's rows, each domain's own, and sample generations; for agentic RL
    the success rate over the held-out environment seeds (``flows/agentic.py``)."""
    if engines.env_workers:
        return agentic_eval(config, engines)
    sampling = SamplingParams(max_new_tokens=config.rollout.max_new_tokens, temperature=config.eval.temperature,
                              stop_token_ids=engines.stop_token_ids, seed=config.run.seed)
    per_domain, samples, correct, total = {}, [], 0.0, 0
    for domain in domains:
        rows = domain.heldout_rows[: config.eval.num_prompts] if config.eval.num_prompts else domain.heldout_rows
        accuracy, domain_samples = evaluate(engines.rollouts, engines.reward_worker, quote(rows), sampling,
                                            score_spec(config, domain, engines), timeout_s=config.rollout.timeout_s)
        per_domain[domain.name] = accuracy
        samples += domain_samples
        correct, total = correct + accuracy * len(rows), total + len(rows)
    return correct / max(total, 1), per_domain, samples


def eval_metrics(accuracy: float, per_domain: dict[str, float]) -> dict[str, float]:
    metrics = {"eval/heldout_accuracy": accuracy}
    if any("/" in name for name in per_domain):  # agentic: the per-environment metrics, named already
        metrics.update(per_domain)
    elif list(per_domain) != ["default"]:
        metrics.update({f"eval/{name}/accuracy": value for name, value in per_domain.items()})
    return metrics


@flow(name="rlvr", persist_result=False)
def rlvr_flow(config: Config, model_path: str, tracking_uri: str, mlflow_run_id: str, stage: str = "rlvr") -> dict:
    """RL from ``model_path`` with ``config.algorithm``; returns the final ``RLState`` as JSON (step, data
    position, held-out accuracies, KL coefficient, running reward moments, the checkpoint steps resumed from).
    ``stage``: ``rlvr``, ``onpolicy_distill`` (the teachers' per-token advantage, ``onpolicy_distill:``) or
    ``agentic`` (episodes of ``agentic.env`` in place of prompts, ``flows/agentic.py``);
    each keeps its checkpoints and output in its own folders (``flows/setup.py``)."""
    cfg, run_dir = config, checkpoint_root(config, stage)
    domains = [] if stage == "agentic" else load_domains(cfg)
    tracker = RunTracker(tracking_uri, mlflow_run_id)
    latest = store.latest_checkpoint(run_dir)
    engines = start_rl_engines(cfg, model_path, restoring=latest is not None, domains=domains, stage=stage)
    record_engines(run_dir, engines)

    state = RLState(mlflow_run_id=mlflow_run_id, kl_coef=cfg.algorithm.kl.coef)
    if latest is not None:
        state = RLState.from_json(restore(engines.train_engines, latest[1]))
        state.resumed_from.append(state.step)  # each attempt's starting checkpoint
        state.discarded_groups, state.untrained_groups = state.discarded_groups + state.untrained_groups, 0
    sync = lambda version: push_weights(cfg, engines, engines.rollouts, version)  # noqa: E731 (every replica, as it is now)
    sync(state.weights_version)
    reward_failures = RewardFailureMonitor(max_failure_rate=cfg.reward.max_failure_rate,
                                           patience=cfg.reward.failure_patience, streaks=state.reward_failures)
    ahead = None
    if cfg.async_.mode == "one_step":
        ahead = OneStepAhead(lambda step, positions: sample_step(cfg, engines, domains, positions, step, reward_failures),
                             sync, state.weights_version, cfg.train.steps)
        saved = store.read_bytes(store.join(latest[1], PENDING_FILE)) if latest is not None else None
        if saved is not None:
            ahead.restore(*load_pending(saved))
    if state.step == 0:
        accuracy, per_domain, samples = heldout_eval(cfg, engines, domains)
        state.heldout_accuracy["0"] = accuracy
        tracker.log_step("eval", 0, eval_metrics(accuracy, per_domain))
        tracker.log_samples("eval_step_000000", samples[: cfg.tracking.num_samples])

    stream = None
    if cfg.async_.mode == "full" and state.step < cfg.train.steps:  # after the evaluation: its weights are v0's alone
        if engines.env_workers:
            stream = EpisodeStream(cfg, engines, state.domain_positions.get("episode_groups", 0), state.weights_version,
                                   partial(group_specs, cfg), partial(episode_batch, cfg))
        else:
            stream = RolloutStream(cfg, engines, domains, state.domain_positions, state.weights_version,
                                   lambda call: call_sampling(cfg, engines, call),
                                   lambda domain: score_spec(cfg, domain, engines))

    progress = StageProgress("rl", cfg.train.steps, start=state.step,
                             keys=("reward/mean", "eval/heldout_accuracy", "time/step"))
    with tracker.sent_on_error(), ExitStack() as closes:  # a failing run's last metrics are the ones to see
        for background in (ahead, stream):
            if background is not None:
                closes.callback(background.close)
        for step in range(state.step + 1, cfg.train.steps + 1):
            step_start = time.perf_counter()
            tracker.flush_if_due(cfg.tracking.flush_every_s)  # earlier steps' metrics, timed as part of this step
            scored, metrics = rl_step(cfg, engines, domains, state, step, reward_failures=reward_failures, ahead=ahead,
                                      stream=stream)
            if stream is not None:
                metrics["async/discarded_groups"] = float(state.discarded_groups)
            if step == cfg.train.steps or (cfg.eval.every and step % cfg.eval.every == 0):
                with timed(metrics, "time/evaluate"):  # evaluation and its sample table
                    if ahead is not None:
                        ahead.settle(state.weights_version)  # the batch in flight done, the newest weights synced
                    accuracy, per_domain, samples = heldout_eval(cfg, engines, domains)
                    tracker.log_samples(f"eval_step_{step:06d}", samples[: cfg.tracking.num_samples])
                state.heldout_accuracy[str(step)] = accuracy
                metrics.update(eval_metrics(accuracy, per_domain))
            if scored.samples:
                tracker.log_samples(f"episodes_step_{step:06d}", scored.samples)
            elif cfg.tracking.sample_every and step % cfg.tracking.sample_every == 0 and not engines.env_workers:
                tracker.log_samples(f"rollouts_step_{step:06d}", rollout_samples(
                    engines.reward_worker, scored.rollouts_ref, scored.rewards_ref, quote(scored.prompts),
                    quote(scored.columns), cfg.tracking.num_samples))
            metrics["time/step"] = time.perf_counter() - step_start
            tracker.log_step("rl", step, metrics, flush=False)
            progress.update(step, metrics)

            if step % cfg.checkpoint.every == 0 or step == cfg.train.steps:
                tracker.flush()  # before a checkpoint can claim these steps: a resume re-runs only unsent ones
                extra = pending_files(ahead)  # waits for the batch in flight: its scoring counts in the streaks saved
                state.reward_failures = reward_failures.state()
                if stream is not None:  # the data position after every group drawn; those not trained yet, counted
                    state.domain_positions, state.untrained_groups = stream.snapshot()
                checkpoint(engines.train_engines, run_dir, step, state.to_json(), cfg.checkpoint.keep, quote(extra))
    progress.close()
    tracker.flush()
    save_model(engines.trainer, stage_dir(cfg, stage), state.step, state.to_json(), key=stage_key(cfg, stage, model_path))
    engines.stop()
    return state.to_json()
