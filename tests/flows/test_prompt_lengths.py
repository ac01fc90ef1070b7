"""A prompt that, with rollout.max_new_tokens, does not fit the model's positions stops the run before any
engine starts, in one line naming the prompt's token count, max_new_tokens and the limit."""

from __future__ import annotations

import pytest

from configs.loader import ConfigError, load_config
from engines.models import TinyModelSpec, build_tiny_model
from flows.setup import check_prompt_lengths


def test_longest_prompt_plus_max_new_tokens_must_fit_the_positions(tmp_path):
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "12+34+56+78=", "answer": "180"}]
    model_path = str(build_tiny_model(tmp_path / "model", [r["prompt"] + r["answer"] for r in rows], TinyModelSpec(),
                                      seed=0))  # its tokenizer is trained on these rows, as a run's base model's is
    # The tiny tokenizer splits digits one by one and "+", "=" are pre-tokens of their own: 8 digits, 3 "+" and
    # "=" are 12 tokens. The default tiny model has 128 positions, so 116 new tokens fit exactly.
    longest, limit = 12, 128

    def with_new_tokens(n: int):
        return load_config("tiny", [f"rollout.max_new_tokens={n}"])

    check_prompt_lengths(with_new_tokens(limit - longest), model_path, rows)
    with pytest.raises(ConfigError) as info:
        check_prompt_lengths(with_new_tokens(limit - longest + 1), model_path, rows)
    assert str(info.value) == (
        f"rollout.max_new_tokens: the longest prompt ('12+34+56+78='…) is {longest} tokens; with max_new_tokens "
        f"{limit - longest + 1} that is {limit + 1}, over the model's {limit} positions "
        "(model.tiny.max_position_embeddings); lower rollout.max_new_tokens, shorten the longest prompts or use a "
        "model with more positions (raise model.tiny.max_position_embeddings)")


def test_a_hub_model_is_not_checked():
    # Its positions are unknown without downloading it (the schema skips it too), so no tokenizer is loaded.
    config = load_config("tiny", ["model.source=hf", "model.path=no-such-org/no-such-model"])
    check_prompt_lengths(config, "no-such-org/no-such-model", [{"prompt": "x" * 10_000, "answer": ""}])
