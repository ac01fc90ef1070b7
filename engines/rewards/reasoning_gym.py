"""``reasoning_gym``: scores a completion with the reasoning-gym dataset that generated its prompt.

reasoning-gym (Stojanovski et al. 2025, arXiv:2505.24760) generates procedural tasks (arithmetic,
counting, puzzles, …) from a dataset name, a config and a seed, and ships a verifier for each:
``dataset.score_answer(answer, entry) -> float`` in [0, 1] (some give partial credit, e.g. for a
near-miss format). A RollFlow row carries what is needed to regenerate its entry exactly:

- ``rg_dataset`` (str): the reasoning-gym dataset name, e.g. ``"basic_arithmetic"``;
- ``rg_config`` (str, JSON): that dataset's config, ``seed`` and ``size`` included;
- ``rg_index`` (int): the entry's index in it.

The reward rebuilds ``reasoning_gym.create_dataset(rg_dataset, **rg_config)[rg_index]`` (datasets are
cached per name and config for the process) and scores the text inside the completion's last
``<answer>…</answer>``, or the whole stripped completion when there is none. ``make_rows`` writes such
rows (``configs/data/make_reasoning.py`` uses it to regenerate ``configs/data/reasoning``).

A verifier that raises on an odd completion scores that completion 0.0 and counts a ``score_error``
event; an unknown dataset name or a bad config raises, since that is a dataset bug. reasoning_gym is
imported on first use (~1 s), so importing ``engines.rewards`` stays fast.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

from engines.rewards import REWARDS, Scored

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_DATASETS: dict[tuple[str, str], Any] = {}  # (name, canonical config JSON) -> reasoning-gym dataset
_DATASETS_LOCK = threading.Lock()


@REWARDS.register("reasoning_gym")
def reasoning_gym_reward(
    prompts: list[str],
    completions: list[str],
    *,
    rg_dataset: list[str],
    rg_config: list[str | dict],
    rg_index: list[int],
    **_: Any,
) -> Scored:
    """Per completion, its reasoning-gym entry's ``score_answer`` of the extracted answer.

    >>> rows = make_rows("basic_arithmetic", 1, 7, min_terms=2, max_terms=2, max_digits=1, operators=["+"],
    ...                  allow_parentheses=False, allow_negation=False)
    >>> rows[0]["prompt"], rows[0]["answer"]
    ('Calculate 6 + 10.', '16')
    >>> columns = {k: [rows[0][k]] * 2 for k in ("rg_dataset", "rg_config", "rg_index")}
    >>> reasoning_gym_reward(["Q", "Q"], ["<think>6+10</think><answer>16</answer>", "15"], **columns)
    Scored(rewards=[1.0, 0.0], events={})
    """
    if not len(prompts) == len(completions) == len(rg_dataset) == len(rg_config) == len(rg_index):
        raise ValueError(
            f"reasoning_gym_reward needs aligned lists; got {len(prompts)} prompts, {len(completions)} completions, "
            f"{len(rg_dataset)} rg_dataset, {len(rg_config)} rg_config and {len(rg_index)} rg_index"
        )
    rewards, errors = [], 0
    for completion, name, config, index in zip(completions, rg_dataset, rg_config, rg_index):
        dataset = _dataset(name, config)
        entry = dataset[int(index)]
        try:
            rewards.append(float(dataset.score_answer(answer=extract_answer(completion), entry=entry)))
        except Exception:  # a verifier choking on odd model output scores 0, counted
            rewards.append(0.0)
            errors += 1
    return Scored(rewards, {"score_error": errors} if errors else {})


def extract_answer(completion: str) -> str:
    """The stripped text of the last ``<answer>…</answer>``, else the stripped completion.

    >>> extract_answer("<think>3 legs each</think> <answer> 12 </answer>"), extract_answer(" 12\\n")
    ('12', '12')
    """
    found = _ANSWER.findall(completion)
    return (found[-1] if found else completion).strip()


def make_rows(name: str, size: int, seed: int, **config: Any) -> list[dict]:
    """``size`` RollFlow rows (``prompt``, ``answer``, ``rg_dataset``, ``rg_config``, ``rg_index``) of the
    reasoning-gym dataset ``name`` built with ``seed`` and ``config``; the same arguments give the same rows.

    ``config`` must be JSON-serialisable (lists, not tuples): rows store it as JSON and the reward
    rebuilds the dataset from that, so the rows are made from the stored config too.
    """
    rg_config = _canonical({**config, "seed": seed, "size": size})
    dataset = _dataset(name, rg_config)
    rows = []
    for index in range(size):
        entry = dataset[index]
        rows.append({"prompt": entry["question"], "answer": str(entry["answer"]), "rg_dataset": name,
                     "rg_config": rg_config, "rg_index": index})
    return rows


def _canonical(config: str | dict) -> str:
    if isinstance(config, str):
        config = json.loads(config)
    if not isinstance(config, dict):
        raise ValueError(f"rg_config must be a JSON object of dataset settings, got {config!r}")
    return json.dumps(config, sort_keys=True)


def _dataset(name: str, config: str | dict):
    key = (name, _canonical(config))
    with _DATASETS_LOCK:  # building one can take a while; one thread builds, the others wait for it
        if key not in _DATASETS:
            import reasoning_gym  # imported on first use: ~1 s, and only the reasoning domain needs it

            try:
                _DATASETS[key] = reasoning_gym.create_dataset(name, **json.loads(key[1]))
            except Exception as exc:
                raise ValueError(f"reasoning-gym cannot build dataset {name!r} with config {key[1]}: {exc}") from exc
        return _DATASETS[key]
