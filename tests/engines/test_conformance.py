"""The engine contract (``engines.protocols``), checked on every backend, reward function and environment.

Adding a backend is one entry in a list below: ``ROLLOUT_BACKENDS`` or ``TRAIN_BACKENDS`` (a trainer is
also checked as a scoring engine), or ``SCORING_BACKENDS`` for a scoring-only engine (reference,
teacher). An entry names the backend's ``engines.backends`` kind (registered short name or dotted path)
and the constructor keywords that build it on the tiny model; wrap it in ``pytest.param(...,
marks=pytest.mark.gpu)`` when it needs a device. A new reward adds a row to ``REWARD_SAMPLES``, an
environment a factory to ``ENVS``. Every registered engine backend must appear here
(``test_every_registered_backend_is_in_the_suite``).
"""

from __future__ import annotations

import asyncio
import inspect
import typing
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from engines.algorithms.objective import SFTObjective
from engines.backends import BACKENDS, engine_class
from engines.data.sft import sft_batch
from engines.environments import ENVIRONMENTS
from engines.environments import names as environment_names
from engines.protocols import Env, RewardFn, RolloutEngine, ScoringEngine, TrainEngine
from engines.rewards import Scored, get_reward, reward_names
from engines.training.torch import OptimSpec
from engines.types import SamplingParams, build_train_batch
from remote_engines import ActorProxy


@dataclass(frozen=True)
class Backend:
    """An engine backend as the suite builds it: ``engine_class(kind)(model_dir, **kwargs)``."""

    kind: str  # "<role>/<name>", e.g. "rollout/hf" or "train/my_pkg.engine:MyTrainer"
    kwargs: dict[str, Any] = field(default_factory=dict)
    remote: bool = False  # runs in its own venv (engines.backends.ENVS): built as a Ray actor behind a proxy
    ranks: int = 0  # a sharded engine (engines.backends.RANKED): this many rank actors behind a proxy

    def make(self, model_dir: str):
        if self.remote or self.ranks:
            return ActorProxy(self.kind, model_dir, world_size=self.ranks, **self.kwargs)
        return engine_class(self.kind)(model_dir, **self.kwargs)


ROLLOUT_BACKENDS = [Backend("rollout/hf"),
                    pytest.param(Backend("rollout/vllm", remote=True), marks=[pytest.mark.ray, pytest.mark.vllm])]
TRAIN_BACKENDS = [Backend("train/torch", {"optim": OptimSpec(lr=1e-3)}),
                  pytest.param(Backend("train/fsdp2", {"optim": OptimSpec(lr=1e-3)}, ranks=2), marks=pytest.mark.ray),
                  pytest.param(Backend("train/deepspeed", {"optim": OptimSpec(lr=1e-3), "zero_stage": 3}, ranks=2),
                               marks=pytest.mark.ray)]
SCORING_BACKENDS = [Backend("reference/torch"), Backend("teacher/torch"), *TRAIN_BACKENDS]

PROMPTS = ["12+3=", "1+1=", "29+30=", "7+8="]


@pytest.fixture(autouse=True)
def _ray_for_remote_backends(request):
    """Start the suite's Ray cluster for a test of a remote backend, and stop its actors after it."""
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    remote = any(getattr(p, "remote", False) or getattr(p, "ranks", 0) for p in params.values())
    if remote:
        request.getfixturevalue("ray_cluster")
    yield
    from engines.actors import run_actor_names, stop_named

    if remote:
        for name in run_actor_names("conformance"):
            stop_named(name)



def _kind(entry) -> str:
    return (entry.values[0] if hasattr(entry, "values") else entry).kind  # a Backend, or one in pytest.param


rollout_backends = pytest.mark.parametrize("rollout_backend", ROLLOUT_BACKENDS, ids=_kind)
train_backends = pytest.mark.parametrize("train_backend", TRAIN_BACKENDS, ids=_kind)
scoring_backends = pytest.mark.parametrize("scoring_backend", SCORING_BACKENDS, ids=_kind)


# -- methods and signatures ------------------------------------------------------------------------------

def protocol_methods(protocol: type) -> list[str]:
    """The methods ``protocol`` declares, its Protocol bases' included."""
    names = set()
    for base in protocol.__mro__:
        if base not in (object, typing.Protocol, typing.Generic):
            names |= {n for n, v in vars(base).items() if callable(v) and (not n.startswith("_") or n == "__call__")}
    return sorted(names)


def signature_mismatches(obj: Any, protocol: type) -> list[str]:
    """How ``obj``'s methods differ from ``protocol``'s: a method takes each declared parameter under the
    same name and in the same place; extra parameters have defaults (or, where the protocol takes
    ``**columns``, are keyword-only columns)."""
    problems = []
    for name in protocol_methods(protocol):
        if not callable(getattr(obj, name, None)):
            problems.append(f"{name}: missing")
            continue
        declared = list(inspect.signature(getattr(protocol, name)).parameters.values())[1:]  # without self
        actual = list(inspect.signature(obj if name == "__call__" else getattr(obj, name)).parameters.values())
        named = [p for p in declared if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        takes_columns = any(p.kind is p.VAR_KEYWORD for p in declared)
        for i, want in enumerate(named):
            have = actual[i] if i < len(actual) and want.kind is want.POSITIONAL_OR_KEYWORD else \
                next((p for p in actual if p.name == want.name), None)
            if have is None or have.name != want.name or have.kind not in (want.kind, have.POSITIONAL_OR_KEYWORD):
                problems.append(f"{name}: parameter {want.name!r} ({want.kind.description}) not taken as declared")
        if takes_columns and not any(p.kind is p.VAR_KEYWORD for p in actual):
            problems.append(f"{name}: takes no **columns")
        for extra in actual[len(named):]:
            if extra.name in {p.name for p in named} or extra.kind in (extra.VAR_POSITIONAL, extra.VAR_KEYWORD):
                continue
            if extra.default is extra.empty and not (takes_columns and extra.kind is extra.KEYWORD_ONLY):
                problems.append(f"{name}: extra parameter {extra.name!r} has no default")
    return problems


class _Partial:
    """Has only ``generate``: not a rollout engine."""

    def generate(self, prompts, sampling):
        return None


def test_signature_check_catches_a_renamed_or_missing_parameter():
    class Renamed(_Partial):
        def receive(self, chunk): ...

    assert not isinstance(_Partial(), RolloutEngine)
    assert "receive: parameter 'bucket' (positional or keyword) not taken as declared" in \
        signature_mismatches(Renamed(), RolloutEngine)


@rollout_backends
def test_rollout_engine_conforms(rollout_backend, tiny_model_dir):
    engine = rollout_backend.make(tiny_model_dir)
    assert isinstance(engine, RolloutEngine)
    assert signature_mismatches(engine, RolloutEngine) == []


@train_backends
def test_train_engine_conforms(train_backend, tiny_model_dir):
    engine = train_backend.make(tiny_model_dir)
    assert isinstance(engine, TrainEngine)
    assert signature_mismatches(engine, TrainEngine) == []


@scoring_backends
def test_scoring_engine_conforms(scoring_backend, tiny_model_dir):
    engine = scoring_backend.make(tiny_model_dir)
    assert isinstance(engine, ScoringEngine)
    assert signature_mismatches(engine, ScoringEngine) == []


def test_every_registered_backend_is_in_the_suite():
    suite = {_kind(entry) for entry in ROLLOUT_BACKENDS + TRAIN_BACKENDS + SCORING_BACKENDS}
    registered = {f"{role}/{name}" for role in ("rollout", "train", "reference", "teacher") for name in BACKENDS[role]}
    assert registered <= suite


# -- generation ------------------------------------------------------------------------------------------

@rollout_backends
def test_generate_returns_consistent_ids_logprobs_and_finish_reasons(rollout_backend, tiny_model_dir):
    engine = rollout_backend.make(tiny_model_dir)
    prompt_ids = [engine.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS] * 3
    sampling = SamplingParams(max_new_tokens=5, temperature=1.0, seed=3)
    out = engine.generate(prompt_ids, sampling)
    rows, width = len(prompt_ids), int(out.response_lengths.max())
    assert out.prompt_ids == prompt_ids  # token in, token out
    assert out.response_ids.shape == out.logprobs.shape == (rows, width) and width <= 5
    assert out.response_ids.dtype == torch.long and out.logprobs.dtype == torch.float32
    assert out.response_lengths.shape == (rows,) and len(out.finish_reasons) == len(out.completions) == rows
    eos = engine.tokenizer.eos_token_id
    for i, reason in enumerate(out.finish_reasons):
        n = int(out.response_lengths[i])
        assert 1 <= n <= 5
        # "stop": the last token is a stop token; "length": max_new_tokens tokens and no stop token
        assert reason == ("stop" if int(out.response_ids[i, n - 1]) == eos else "length")
        assert reason == "stop" or n == 5
        assert (out.logprobs[i, :n] < 0).all() and (out.logprobs[i, n:] == 0).all()
    assert out.weights_version == engine.weights_version() == 0
    again = engine.generate(prompt_ids, sampling)
    assert torch.equal(again.response_ids, out.response_ids) and torch.equal(again.logprobs, out.logprobs)


# -- versioned weight updates ----------------------------------------------------------------------------

def _sft_step(trainer, model_dir: str) -> dict[str, float]:
    """One SFT step on two arithmetic rows: moves every weight the loss reaches."""
    return trainer.train_step(sft_batch(model_dir, ["1+2=", "10+20="], ["3", "30"]), SFTObjective())


@rollout_backends
@train_backends
def test_versioned_update_makes_the_rollout_engine_hold_the_trainers_weights(rollout_backend, train_backend,
                                                                              tiny_model_dir):
    rollout, trainer = rollout_backend.make(tiny_model_dir), train_backend.make(tiny_model_dir)
    assert rollout.weights_checksum() == trainer.weights_checksum()  # both loaded the same model …
    _sft_step(trainer, tiny_model_dir)
    assert rollout.weights_checksum() != trainer.weights_checksum()  # … until the trainer stepped
    buckets = trainer.export_weights(1 << 14)
    assert len(buckets) > 1  # several receive calls

    rollout.begin_update(7)
    received = sum(rollout.receive(bucket) for bucket in buckets)
    report = rollout.commit(7)

    assert report.checksum == rollout.weights_checksum() == trainer.weights_checksum()
    assert report.version == rollout.weights_version() == 7
    assert report.tensors == received == sum(len(b.metas) for b in buckets)
    assert report.nbytes == sum(b.data.nbytes for b in buckets)
    out = rollout.generate(PROMPTS, SamplingParams(max_new_tokens=3, seed=0))
    assert out.weights_version == 7
    # the rollout engine samples from the trainer's distribution: its logprobs are the trainer's
    batch = build_train_batch(out, rollout.tokenizer.pad_token_id)
    gap = (trainer.logprobs(batch) - batch.tensors["rollout_logprobs"]) * batch.loss_mask
    assert gap.abs().max() < 1e-4


@rollout_backends
@train_backends
def test_out_of_order_update_calls_fail_and_the_engine_recovers(rollout_backend, train_backend, tiny_model_dir):
    rollout, trainer = rollout_backend.make(tiny_model_dir), train_backend.make(tiny_model_dir)
    _sft_step(trainer, tiny_model_dir)
    buckets = trainer.export_weights(1 << 14)
    before = rollout.weights_checksum()
    with pytest.raises(RuntimeError, match="begin_update"):
        rollout.receive(buckets[0])
    with pytest.raises(RuntimeError, match="begin_update"):
        rollout.commit(1)
    rollout.begin_update(1)
    with pytest.raises(RuntimeError, match="v1"):
        rollout.begin_update(2)  # v1 is still open
    with pytest.raises(RuntimeError, match="v1"):
        rollout.commit(2)
    rollout.receive(buckets[0])
    with pytest.raises(RuntimeError):
        rollout.generate(PROMPTS, SamplingParams(max_new_tokens=2))  # half-updated weights
    with pytest.raises(ValueError, match="incomplete"):
        rollout.commit(1)  # only the first bucket arrived
    assert rollout.weights_version() == 0 and rollout.weights_checksum() != before

    rollout.begin_update(1)  # a retried sync re-opens the open version and sends everything
    for bucket in buckets:
        rollout.receive(bucket)
    assert rollout.commit(1).checksum == trainer.weights_checksum()
    assert rollout.weights_version() == 1
    with pytest.raises(RuntimeError, match="begin_update"):
        rollout.commit(1)  # committed already


# -- memory ----------------------------------------------------------------------------------------------

@rollout_backends
@pytest.mark.parametrize("free, restore", [("offload", "reload"), ("sleep", "wake")])
def test_rollout_offload_and_sleep_keep_weights_and_generation(rollout_backend, free, restore, tiny_model_dir):
    engine = rollout_backend.make(tiny_model_dir)
    sampling = SamplingParams(max_new_tokens=4, seed=5)
    checksum, out = engine.weights_checksum(), engine.generate(PROMPTS, sampling)
    getattr(engine, free)()
    getattr(engine, free)()  # idempotent
    with pytest.raises(RuntimeError):
        engine.generate(PROMPTS, sampling)
    getattr(engine, restore)()
    getattr(engine, restore)()
    again = engine.generate(PROMPTS, sampling)
    assert engine.weights_checksum() == checksum
    assert torch.equal(again.response_ids, out.response_ids) and torch.equal(again.logprobs, out.logprobs)


@scoring_backends
def test_scoring_offload_reload_keeps_logprobs(scoring_backend, tiny_model_dir):
    engine = scoring_backend.make(tiny_model_dir)
    batch = sft_batch(tiny_model_dir, ["1+2=", "10+20="], ["3", "30"])
    logprobs = engine.logprobs(batch)
    engine.offload()
    engine.reload()
    assert torch.equal(engine.logprobs(batch), logprobs)


@train_backends
def test_train_offload_reload_keeps_weights_and_optimizer_state(train_backend, tiny_model_dir):
    moved, kept = train_backend.make(tiny_model_dir), train_backend.make(tiny_model_dir)
    for trainer in (moved, kept):
        _sft_step(trainer, tiny_model_dir)  # Adam moments now exist
    moved.offload()
    moved.reload()
    assert moved.weights_checksum() == kept.weights_checksum()
    for trainer in (moved, kept):
        _sft_step(trainer, tiny_model_dir)
    assert moved.weights_checksum() == kept.weights_checksum()  # the same second step: moments came back


@train_backends
def test_train_save_load_round_trip(train_backend, tiny_model_dir, tmp_path):
    saved, loaded = train_backend.make(tiny_model_dir), train_backend.make(tiny_model_dir)
    _sft_step(saved, tiny_model_dir)
    saved.save(str(tmp_path / "ckpt"))
    assert loaded.load(str(tmp_path / "ckpt")) == saved.weights_checksum() == loaded.weights_checksum()
    torch.manual_seed(1)  # load restores the RNG of the save, so the next steps match
    saved.load(str(tmp_path / "ckpt"))
    for trainer in (saved, loaded):
        _sft_step(trainer, tiny_model_dir)
    assert saved.weights_checksum() == loaded.weights_checksum()


# -- rewards ---------------------------------------------------------------------------------------------

# name -> (completions, columns and options, expected rewards), or why a call does not belong here
REWARD_SAMPLES: dict[str, tuple[list[str], dict[str, Any], list[float]] | str] = {
    "math": (["4", "5"], {"answer": ["4", "4"]}, [1.0, 0.0]),  # 2+2: right, wrong
    "think_answer_format": (["<think>a</think><answer>4</answer>", "4"], {}, [1.0, 0.0]),  # both blocks; none
    "regex_match": (["42", "4+2"], {"pattern": r"\d{1,2}"}, [1.0, 0.0]),  # a bare number; an expression
    "ifeval": (["all good", "All good"], {"constraints": [[{"type": "lowercase"}]] * 2}, [1.0, 0.0]),
    # 0.8 * math + 0.2 * format: right answer in blocks 1.0; right answer without blocks 0.8
    "weighted": (["<think>a</think><answer>4</answer>", "4"],
                 {"answer": ["4", "4"], "components": "math:0.8,think_answer_format:0.2"}, [1.0, 0.8]),
    "code": "runs a sandbox: tests/engines/rewards/test_code_reward.py",
    "judge": "needs a judge engine actor: tests/engines/rewards/test_judge_reward.py",
    "reasoning_gym": "needs reasoning_gym's datasets: tests/engines/rewards/test_reasoning_gym_reward.py",
}


def test_every_registered_reward_has_a_sample():
    assert sorted(REWARD_SAMPLES) == reward_names()


@pytest.mark.parametrize("name", reward_names())
def test_reward_conforms(name):
    fn = get_reward(name)
    assert isinstance(fn, RewardFn)
    assert signature_mismatches(fn, RewardFn) == []
    sample = REWARD_SAMPLES[name]
    if isinstance(sample, str):
        pytest.skip(sample)
    completions, columns, expected = sample

    def call(**extra):
        result = fn(["2+2="] * len(completions), completions, **columns, **extra)
        result = asyncio.run(result) if inspect.isawaitable(result) else result
        return result.rewards if isinstance(result, Scored) else result

    assert call() == pytest.approx(expected)
    assert call(unrelated_column=["x"] * len(completions)) == pytest.approx(expected)  # other columns ignored


# -- environments ----------------------------------------------------------------------------------------

class CountdownEnv:
    """A toy text environment (the contract's smallest example): say "go" three times."""

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.left = 3
        return "say go", {"seed": seed}

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.left -= action_text.strip() == "go"
        return f"{self.left} left", float(self.left == 0), self.left == 0, False, {}

    def close(self) -> None:
        pass


ENVS = [CountdownEnv, *(ENVIRONMENTS.get(name) for name in environment_names())]


@pytest.mark.parametrize("make_env", ENVS, ids=lambda cls: cls.__name__)
def test_env_conforms(make_env):
    env = make_env()
    assert isinstance(env, Env) and signature_mismatches(env, Env) == []
    obs, info = env.reset(seed=0)
    assert isinstance(obs, str) and isinstance(info, dict)
    obs, reward, terminated, truncated, info = env.step("go")
    assert isinstance(obs, str) and isinstance(reward, float) and isinstance(info, dict)
    assert isinstance(terminated, bool) and isinstance(truncated, bool)
