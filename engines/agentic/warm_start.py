"""SFT rows for an agentic warm start: episodes of random valid moves, as multi-turn conversations.

The model learns the turn format and the action set, not the task: every action is drawn uniformly from
the environment's valid actions (``valid_actions()``), so the warm-started policy is about as good as a
random one and RL has the task to learn."""

from __future__ import annotations

import random

from engines import environments


def random_move_rows(env_id: str, options: dict, episodes: int, seed: int, max_turns: int,
                     system: bool = False) -> list[dict]:
    """``episodes`` conversations ``{"messages": [...]}``: the environment's observations as user turns and
    random valid actions as assistant turns, at most ``max_turns`` actions each. Environment seeds come
    from ``seed`` (keep them apart from the RL and held-out seeds)."""
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
        rows.append({"messages": messages})
    return rows
