import doctest
import json
from pathlib import Path

import pytest

import engines.rewards.reasoning_gym as rg_module
from engines.rewards import get_reward
from engines.rewards.reasoning_gym import extract_answer, make_rows, reasoning_gym_reward

DATA = Path(__file__).resolve().parents[3] / "configs" / "data" / "reasoning"
FILE_ROWS = [row for path in sorted(DATA.glob("*.jsonl")) for row in map(json.loads, path.read_text().splitlines())]
COLUMNS = ("rg_dataset", "rg_config", "rg_index")

# "Calculate 6 + 10." with reference "16" (the docstring example's row).
ROW = make_rows("basic_arithmetic", 1, 7, min_terms=2, max_terms=2, max_digits=1, operators=["+"],
                allow_parentheses=False, allow_negation=False)[0]


def score(rows: list[dict], completions: list[str]):
    return reasoning_gym_reward(["Q"] * len(rows), completions, **{k: [row[k] for row in rows] for k in COLUMNS})


# (completion, expected reward for "Calculate 6 + 10." = 16) — the comment says why.
TABLE = [
    ("16", 1.0),  # the answer alone
    (" 16\n", 1.0),  # whitespace is stripped
    ("<think>6 + 10 is 16</think>\n<answer>16</answer>", 1.0),  # the text inside <answer> is scored
    ("<answer> 16 </answer>", 1.0),  # and stripped
    ("<answer>15</answer> no wait <answer>16</answer>", 1.0),  # the last <answer> counts
    ("<answer>16</answer> no wait <answer>15</answer>", 0.0),  # the last <answer> is wrong
    ("15", 0.0),  # wrong
    ("", 0.0),  # empty
    ("The answer is 16", 2 / 16),  # reasoning-gym's partial credit: "16" inside 16 characters
    ("16.0", 2 / 4),  # not the exact string: partial credit 2 of 4 characters
    ("<answer>16", 2 / 10),  # an unclosed tag is not extracted: the whole text is scored
]


@pytest.mark.parametrize(("completion", "expected"), TABLE)
def test_reward_table(completion, expected):
    assert ROW["prompt"] == "Calculate 6 + 10." and ROW["answer"] == "16"
    assert score([ROW], [completion]).rewards == [pytest.approx(expected)]


def test_file_references_score_one_and_wrong_answers_less():
    assert len(FILE_ROWS) >= 32
    references = score(FILE_ROWS, [row["answer"] for row in FILE_ROWS])
    tagged = score(FILE_ROWS, [f"<think>hmm</think><answer>{row['answer']}</answer>" for row in FILE_ROWS])
    wrong = score(FILE_ROWS, [str(int(row["answer"]) + 1) for row in FILE_ROWS])  # every answer is an integer
    assert references.rewards == [1.0] * len(FILE_ROWS) and references.events == {}
    assert tagged.rewards == [1.0] * len(FILE_ROWS)
    assert all(reward < 1.0 for reward in wrong.rewards)


def test_config_may_be_a_dict():
    row = {**ROW, "rg_config": json.loads(ROW["rg_config"])}
    assert score([row], ["16"]).rewards == [1.0]


def test_datasets_are_built_once_per_name_and_config(monkeypatch):
    import reasoning_gym

    calls = []
    real = reasoning_gym.create_dataset
    monkeypatch.setattr(rg_module, "_DATASETS", {})
    def counting(name, **config):
        calls.append(name)
        return real(name, **config)

    monkeypatch.setattr(reasoning_gym, "create_dataset", counting)
    reordered = {**ROW, "rg_config": json.dumps(json.loads(ROW["rg_config"]), sort_keys=False, indent=1)}
    assert score([ROW, ROW, reordered], ["16", "15", "16"]).rewards == [1.0, 0.0, 1.0]
    assert calls == ["basic_arithmetic"]  # the same config written differently is the same dataset


def test_a_verifier_error_scores_zero_and_is_counted(monkeypatch):
    dataset = rg_module._dataset(ROW["rg_dataset"], ROW["rg_config"])

    def broken(answer, entry):
        raise TypeError("verifier broke")

    monkeypatch.setattr(dataset, "score_answer", broken)
    got = score([ROW, ROW], ["16", "x"])
    assert got.rewards == [0.0, 0.0] and got.events == {"score_error": 2}


def test_unknown_dataset_raises():
    row = {**ROW, "rg_dataset": "no_such_dataset"}
    with pytest.raises(ValueError, match="reasoning-gym cannot build dataset 'no_such_dataset'"):
        score([row], ["16"])
    with pytest.raises(ValueError, match="rg_config must be a JSON object"):
        score([{**ROW, "rg_config": "[1, 2]"}], ["16"])


def test_misaligned_lists():
    with pytest.raises(ValueError, match="1 prompts, 2 completions, 1 rg_dataset"):
        reasoning_gym_reward(["Q"], ["a", "b"], **{k: [ROW[k]] for k in COLUMNS})


def test_make_rows_is_reproducible_and_self_describing():
    first = make_rows("leg_counting", 3, 5, max_animals=3)
    assert first == make_rows("leg_counting", 3, 5, max_animals=3)
    assert first != make_rows("leg_counting", 3, 6, max_animals=3)  # another seed, other entries
    assert [row["rg_index"] for row in first] == [0, 1, 2]
    assert json.loads(first[0]["rg_config"]) == {"max_animals": 3, "seed": 5, "size": 3}
    assert set(first[0]) == {"prompt", "answer", "rg_dataset", "rg_config", "rg_index"}


def test_extract_answer():
    assert extract_answer("<answer>a\nb</answer>") == "a\nb"  # multi-line answers are kept whole
    assert extract_answer("no tags ") == "no tags"


def test_registered():
    assert get_reward("reasoning_gym") is reasoning_gym_reward


def test_docstring_examples():
    result = doctest.testmod(rg_module)
    assert result.attempted > 0 and result.failed == 0
