"""Agentic rollouts: token in, token out; masks; limits and endings; the three runners agree."""

from __future__ import annotations

import random
import time

import pytest
import torch

from engines import environments
from engines.agentic.chat import TemplateError, TurnRenderer, check_append_only
from engines.agentic.rollout import (EnginePolicy, EpisodeRun, EpisodeSpec, Generation, Request, RolloutSettings,
                                     Runner, to_rollouts)
from engines.models import load_tokenizer


@pytest.fixture(scope="module")
def engine(agentic_model_dir):
    from engines.inference.hf import HFInferenceEngine

    return HFInferenceEngine(agentic_model_dir, torch_threads=1)


@pytest.fixture(scope="module")
def tokenizer(agentic_model_dir):
    return load_tokenizer(agentic_model_dir)


class Recording:
    """A policy that records every request it is sent, keyed by (episode seed of the request)."""

    def __init__(self, inner):
        self.inner, self.sent = inner, []

    def generate(self, requests):
        self.sent.extend(requests)
        return self.inner.generate(requests)


def _runner(policy, tokenizer, settings, env_id="Corridor-v0", make=None, **options):
    make = make or (lambda spec: environments.make(spec.env_id, **options))
    return Runner(policy, TurnRenderer(tokenizer), settings, make, environments.state_key)


def _specs(n, env_id="Corridor-v0", group_size=4):
    return [EpisodeSpec(env_id, 100 + i // group_size, i // group_size, i, sample_seed=7000 + i) for i in range(n)]


def _prefix_errors(episodes, sent):
    """Turns whose request was not the exact token prefix of the episode's trajectory: the prompt of turn k
    must be the first prompt, then every earlier action and the tokens after it, as the rollout holds them."""
    errors = []
    for episode in episodes:
        mine = [r for r in sent if r.seed // 1 in {episode.spec.request_seed(k) for k in range(len(episode.turns))}]
        for k, turn in enumerate(episode.turns):
            request = next(r for r in mine if r.seed == episode.spec.request_seed(k))
            expected = episode.prompt_ids + [t for prev in episode.turns[:k] for t in (*prev.action_ids, *prev.next_ids)]
            if request.prompt_ids != expected:
                errors.append((episode.spec.index, k))
    return errors


def test_turn_prompts_are_the_exact_token_prefix(engine, tokenizer):
    settings = RolloutSettings(max_turns=5, max_tokens_per_turn=3, max_context=256)
    policy = Recording(EnginePolicy(engine, settings))
    episodes = _runner(policy, tokenizer, settings).run(_specs(8), "async")
    assert sum(len(e.turns) for e in episodes) > 8  # multi-turn episodes
    assert _prefix_errors(episodes, policy.sent) == []
    rollouts = to_rollouts(episodes, tokenizer.pad_token_id)
    for i, episode in enumerate(episodes):
        n = int(rollouts.response_lengths[i])
        assert rollouts.response_ids[i, :n].tolist() == episode.response_ids()
        # the trainer scores the sampled tokens: their logprobs are the engine's, on the model's tokens only
        model = rollouts.response_loss_mask[i, :n].bool()
        assert rollouts.logprobs[i, :n][model].tolist() == pytest.approx([lp for t in episode.turns for lp in t.logprobs])
        assert (rollouts.logprobs[i, :n][~model] == 0).all()


def test_a_decode_reencode_round_trip_fails_the_token_prefix_check(engine, tokenizer, monkeypatch):
    """The check above catches a runner that rebuilds the trajectory from text: ``decode`` strips the stop
    token (and a re-encoding may merge or split tokens), so the next prompt is no longer the sampled tokens."""
    monkeypatch.setattr(EpisodeRun, "_action_tokens", lambda self, turn: tokenizer.encode(turn.text, add_special_tokens=False))
    settings = RolloutSettings(max_turns=5, max_tokens_per_turn=3, max_context=256)
    policy = Recording(EnginePolicy(engine, settings))
    episodes = _runner(policy, tokenizer, settings).run(_specs(8), "async")
    assert _prefix_errors(episodes, policy.sent) != []


def test_masks_cover_the_model_tokens_and_turns_number_the_segments(tokenizer):
    """A scripted two-turn episode by hand: prompt | a0 (2 tokens, stop) | o1 tokens | a1 (1 token, no stop)."""
    settings = RolloutSettings(max_turns=2, max_tokens_per_turn=4, max_context=256)
    eos = tokenizer.eos_token_id
    r_ids = tokenizer.encode("R", add_special_tokens=False)
    script = iter([Generation(r_ids + [eos], [-0.5] * (len(r_ids) + 1), "stop", "R"),
                   Generation(r_ids, [-0.25] * len(r_ids), "length", "R")])

    class Scripted:
        def generate(self, requests):
            return [next(script) for _ in requests]

    [episode] = _runner(Scripted(), tokenizer, settings).run([EpisodeSpec("Corridor-v0", 3, 0, 0, 1)], "serial")
    assert [t.finish for t in episode.turns] == ["stop", "length"]
    first = episode.turns[0]
    # after a stopped action comes the plain format's next user turn and generation header, nothing else
    assert tokenizer.decode(first.next_ids) == f"user:\n{first.observation}{tokenizer.eos_token}assistant:\n"
    assert episode.turns[1].next_ids == []  # nothing follows the last action
    rollouts = to_rollouts([episode], tokenizer.pad_token_id)
    a0, o1, a1 = len(first.action_ids), len(first.next_ids), len(episode.turns[1].action_ids)
    assert rollouts.response_loss_mask[0].tolist() == [1.0] * a0 + [0.0] * o1 + [1.0] * a1
    assert rollouts.response_turn_index[0].tolist() == [1] * (a0 + o1) + [2] * a1
    assert episode.ending == "max_turns" and episode.truncated


def test_runners_give_the_same_trajectories_with_slow_and_uneven_steps(engine, tokenizer):
    """16 episodes whose steps take 0-20 ms: serial, lockstep and async sample the same tokens (each request
    carries its own seed), whatever generation batches the requests land in."""

    class Slow:
        def __init__(self, env, rng):
            self.env, self.rng = env, rng

        def __getattr__(self, name):
            return getattr(self.env, name)

        def step(self, text):
            time.sleep(self.rng.random() * 0.02)
            return self.env.step(text)

    settings = RolloutSettings(max_turns=4, max_tokens_per_turn=3, max_context=256)
    runner = _runner(EnginePolicy(engine, settings), tokenizer, settings,
                     make=lambda spec: Slow(environments.make(spec.env_id), random.Random(spec.index)))
    specs = _specs(16)
    runs = {mode: runner.run(specs, mode) for mode in ("serial", "lockstep", "async")}
    for mode in ("lockstep", "async"):
        for a, b in zip(runs["serial"], runs[mode]):
            assert a.response_ids() == b.response_ids(), mode
            assert [t.reward for t in a.turns] == [t.reward for t in b.turns]
            flat = lambda episode: [lp for t in episode.turns for lp in t.logprobs]  # noqa: E731
            assert flat(a) == pytest.approx(flat(b), abs=1e-4)


def test_context_limit_cuts_the_turn_and_ends_the_episode(engine, tokenizer):
    settings = RolloutSettings(max_turns=50, max_tokens_per_turn=6, max_context=40)
    episodes = _runner(EnginePolicy(engine, settings), tokenizer, settings).run(_specs(4), "serial")
    for episode in episodes:
        assert len(episode.prompt_ids) + len(episode.response_ids()) <= 40
    assert {e.ending for e in episodes} <= {"context", "terminated"}
    assert "context" in {e.ending for e in episodes}


class Failing:
    """Corridor that raises (``mode == "raise"``) or hangs (``"hang"``) on its second step."""

    def __init__(self, mode):
        self.env, self.mode, self.steps = environments.make("Corridor-v0"), mode, 0

    def __getattr__(self, name):
        return getattr(self.env, name)

    def step(self, text):
        self.steps += 1
        if self.steps == 2:
            if self.mode == "raise":
                raise RuntimeError("simulator crashed")
            time.sleep(5)
        return self.env.step(text)


@pytest.mark.parametrize("mode", ["raise", "hang"])
def test_an_environment_that_raises_or_hangs_ends_its_episode_as_error(engine, tokenizer, mode):
    settings = RolloutSettings(max_turns=6, max_tokens_per_turn=3, max_context=256, step_timeout_s=0.5)
    make = lambda spec: Failing(mode) if spec.index == 1 else environments.make(spec.env_id)  # noqa: E731
    start = time.monotonic()
    episodes = _runner(EnginePolicy(engine, settings), tokenizer, settings, make=make).run(_specs(4), "async")
    assert time.monotonic() - start < 4.5  # the hung step did not hold the batch
    failed = episodes[1]
    assert failed.ending == "error" and ("simulator crashed" if mode == "raise" else "took over 0.5s") in failed.error
    assert len(failed.turns) == 2  # the turn whose step failed is kept, with no reward
    assert all(e.ending != "error" for i, e in enumerate(episodes) if i != 1)


class DiesOnCall:
    """A policy whose ``call``-th generate raises, as a rollout engine that died does."""

    def __init__(self, inner, call):
        self.inner, self.call, self.calls = inner, call, 0

    def generate(self, requests):
        self.calls += 1
        if self.calls >= self.call:
            raise RuntimeError("rollout engine died")
        return self.inner.generate(requests)


def test_a_policy_failure_ends_every_async_episode_and_is_raised_not_hung(engine, tokenizer):
    """Episodes whose next turn was not in the failed call wait on later calls: they get the failure too,
    so ``run`` raises it instead of waiting for them forever."""
    import threading

    settings = RolloutSettings(max_turns=6, max_tokens_per_turn=3, max_context=256, batch_wait_s=0.0)
    policy = DiesOnCall(EnginePolicy(engine, settings), call=3)
    runner = _runner(policy, tokenizer, settings)
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(_raised(runner.run, _specs(8), "async")), daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "run() hung after the policy failed"
    assert outcome == ["RuntimeError: rollout engine died"] and policy.calls == 3  # no call after the failure


def _raised(fn, *args) -> str | None:
    try:
        fn(*args)
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"
    return None


def test_the_plain_format_and_an_append_only_template_pass_the_startup_check(tokenizer):
    check_append_only(TurnRenderer(tokenizer))
    chatml = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    check_append_only(TurnRenderer(_with_template(tokenizer, chatml), system="Move."))


def test_a_template_that_drops_earlier_reasoning_is_refused_naming_the_turn(tokenizer):
    """Like Qwen3's template: an assistant turn's <think> block is dropped once a later user turn exists."""
    drops = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
             "{% if m.role == 'assistant' and not loop.last %}{{ m.content.split('</think>')[-1].lstrip() }}"
             "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(TemplateError, match="not append-only at turn 0"):
        check_append_only(TurnRenderer(_with_template(tokenizer, drops)))


def _with_template(tokenizer, template):
    import copy

    clone = copy.deepcopy(tokenizer)
    clone.chat_template = template
    return clone


def test_one_request_seed_per_row_makes_a_row_independent_of_its_batch(engine, tokenizer):
    from engines.types import SamplingParams

    prompt = tokenizer.encode("user:\nG...A.", add_special_tokens=False)
    other = tokenizer.encode("user:\n..A..G", add_special_tokens=False)
    alone = engine.generate([prompt], SamplingParams(max_new_tokens=6, row_seeds=(11,)))
    batched = engine.generate([other, prompt, other], SamplingParams(max_new_tokens=6, row_seeds=(5, 11, 6)))
    n = int(alone.response_lengths[0])
    assert batched.response_ids[1, :n].tolist() == alone.response_ids[0, :n].tolist()
    with pytest.raises(ValueError, match="row_seeds has 1 seeds for 2 prompts"):
        engine.generate([prompt, other], SamplingParams(row_seeds=(1,)))
