"""LLM-as-judge: grades parsed from the judge model's greedy output, scaled to [0, 1], with a fallback."""

from __future__ import annotations

import pytest

from engines.rewards.judge import judge_reward, parse_grade


@pytest.mark.parametrize("text,grade", [
    ("7", 7.0),                      # a bare number
    ("Rating: 8.5 because", 8.5),    # the first number after words
    ("-3 is harsh", -3.0),           # negative: clipped to 0 by the reward, parsed as is here
    ("7/10", 7.0),                   # the first number of a fraction
    ("no grade given", None),        # nothing to parse: the reward's fallback
])
def test_parse_grade(text, grade):
    assert parse_grade(text) == grade


def test_judge_scores_with_a_real_model_and_counts_unparsed_outputs(tiny_model_dir):
    from engines.inference.hf import HFInferenceEngine
    from engines.types import SamplingParams

    # The tiny model was trained on sums: asked "1+2=" style prompts it answers with digits (a grade),
    # or with other text that holds no number (unparsed -> fallback).
    prompts = ["1+2=", "3+4=", "10+5=", "+"]
    template = "{prompt}"
    scored = judge_reward(prompts, ["x"] * 4, model_path=tiny_model_dir, template=template, max_score=100.0,
                          fallback=0.25)
    outputs = HFInferenceEngine(tiny_model_dir).generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0,
                                                                                  seed=0)).completions
    expected = [0.25 if parse_grade(o) is None else min(max(parse_grade(o), 0.0), 100.0) / 100.0 for o in outputs]
    assert scored.rewards == pytest.approx(expected)
    assert scored.events == {"judge_unparsed": sum(parse_grade(o) is None for o in outputs)}
    assert all(0.0 <= r <= 1.0 for r in scored.rewards)


def test_judge_without_a_model_says_what_to_set():
    with pytest.raises(ValueError, match="model_path"):
        judge_reward(["q"], ["a"])
