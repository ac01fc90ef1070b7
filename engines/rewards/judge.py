"""``judge``: an LLM grades each completion against a rubric; the grade, scaled to [0, 1], is the reward.

LLM-as-a-judge (Zheng et al. 2023, arXiv:2306.05685). The judge is any HF causal LM, served by its own
inference engine: in a flow run, the run's ``judge`` actor (``engine_actor``, filled in by the flow);
called directly, an in-process ``HFInferenceEngine`` of ``model_path``. The rubric ``template`` is
formatted with ``{prompt}``, ``{completion}`` and ``{answer}`` (the row's reference, empty if none) and
decoded greedily. The first number in the judge's output is the grade:

    reward = clip(grade, 0, max_score) / max_score

An output with no number scores ``fallback`` and counts as event ``judge_unparsed``.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from engines.rewards import REWARDS, Scored

DEFAULT_TEMPLATE = ("Rate the answer from 0 to {max_score}.\nQuestion: {prompt}\nReference: {answer}\n"
                    "Answer: {completion}\nRating:")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_LOCAL: dict[str, Any] = {}
_LOCAL_LOCK = threading.Lock()


def parse_grade(text: str) -> float | None:
    """The first number in ``text`` (``"7/10"`` → 7.0, ``"Rating: 8.5"`` → 8.5), None if there is none."""
    found = _NUMBER.search(text)
    return float(found.group()) if found else None


def _engine(model_path: str, engine_actor: str):
    if engine_actor:
        import ray

        from engines.actors import NAMESPACE

        actor = ray.get_actor(engine_actor, namespace=NAMESPACE)
        return lambda prompts, sampling: ray.get(actor.generate.remote(prompts, sampling))
    if not model_path:
        raise ValueError("judge needs reward_options.model_path (or runs in a flow that starts its judge engine)")
    with _LOCAL_LOCK:
        if model_path not in _LOCAL:
            from engines.inference.hf import HFInferenceEngine

            _LOCAL[model_path] = HFInferenceEngine(model_path)
    return _LOCAL[model_path].generate


@REWARDS.register("judge")
def judge_reward(prompts: list[str], completions: list[str], *, answer: list[str] | None = None,
                 model_path: str = "", engine_actor: str = "", template: str = DEFAULT_TEMPLATE,
                 max_score: float = 10.0, fallback: float = 0.0, max_new_tokens: int = 8, **_: Any) -> Scored:
    """Grades of ``completions`` by the judge model, in [0, 1].

    >>> parse_grade("Rating: 7 out of 10"), parse_grade("no idea")
    (7.0, None)
    """
    from engines.types import SamplingParams

    references = answer if answer is not None else [""] * len(prompts)
    requests = [template.format(prompt=p, completion=c, answer=a if a is not None else "", max_score=max_score)
                for p, c, a in zip(prompts, completions, references)]
    outputs = _engine(model_path, engine_actor)(requests, SamplingParams(max_new_tokens=max_new_tokens,
                                                                         temperature=0.0, seed=0)).completions
    rewards, unparsed = [], 0
    for text in outputs:
        grade = parse_grade(text)
        if grade is None:
            unparsed += 1
            rewards.append(fallback)
        else:
            rewards.append(min(max(grade, 0.0), max_score) / max_score)
    return Scored(rewards, {"judge_unparsed": unparsed})
