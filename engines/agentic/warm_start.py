"""SFT rows for an agentic warm start: episodes of random valid moves, as multi-turn conversations.

The model learns the turn format and the action set, not the task: every action is drawn uniformly from
the environment's valid actions (``valid_actions()``), so the warm-started policy is about as good as a
random one and RL has the task to learn.

The rows are prompt (the first observation) and completion (every later turn), and the SFT stage trains
on the whole completion, the environment's answers included (``sft.data.source: env``): a world-model
loss. Trained on the random actions alone, a tiny model learns that nothing it reads predicts them and
stops reading: its last hidden state barely differs between observations (spread/norm 0.19 before, 0.004
after 60 steps on Corridor), and RL then has no observation-dependent feature to reinforce; it drifts to
one action everywhere. Predicting the next observation from the last one and the move keeps it reading
(0.13 after 100 steps), and GiGPO then learns Corridor in tens of steps."""

from __future__ import annotations

import random

from engines import environments


def random_move_rows(env_id: str, options: dict, episodes: int, seed: int, max_turns: int,
                     system: bool = False) -> list[dict]:
    """``episodes`` conversations ``{"prompt": [...], "completion": [...]}``: the first observation (after the
    instructions when ``system``), then random valid actions as assistant turns and the environment's
    answers as user turns, at most ``max_turns`` actions each. Environment seeds come from ``seed`` (keep
    them apart from the RL and held-out seeds)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(episodes):
        env = environments.make(env_id, **options)
        observation, _ = env.reset(seed=rng.randrange(2**31))
        messages = [{"role": "system", "content": env.instructions}] if system else []
        messages.append({"role": "user", "content": observation})
        for _ in range(max_turns):
            action = rng.choice(env.valid_actions())
            observation, _, terminated, truncated, _ = env.step(action)
            messages.append({"role": "assistant", "content": action})
            if terminated or truncated:
                break
            messages.append({"role": "user", "content": observation})
        if messages[-1]["role"] == "user":
            messages.pop()
        env.close()
        first = 2 if system else 1  # the prompt: the instructions and the first observation
        rows.append({"prompt": messages[:first], "completion": messages[first:]})
    return rows


def environment_texts(env_id: str, options: dict, episodes: int, seed: int, max_turns: int,
                      system: bool = False) -> list[str]:
    """The text of ``random_move_rows`` as the plain turn format renders it: what a tiny model's tokenizer is
    trained on to read and write environment ``env_id``."""
    from engines.data.synthetic import texts_for_tokenizer

    return texts_for_tokenizer(random_move_rows(env_id, options, episodes, seed, max_turns, system))
