import doctest
import time

import pytest

import engines.rewards.format as format_module
from engines.rewards import REWARDS, Scored, get_reward
from engines.rewards.format import parse_components, think_answer_format, weighted

LOOSE = {"strict": False}
CUSTOM = {"think_tag": "reasoning", "answer_tag": "final"}

# (completion, options, expected reward) — the comment says why.
FORMAT_TABLE = [
    ("<think>a</think><answer>b</answer>", {}, 1.0),  # the layout exactly
    ("\n <think>a</think>\n\n<answer>b</answer>\n", {}, 1.0),  # whitespace around and between is allowed
    ("<think>multi\nline</think><answer>4</answer>", {}, 1.0),  # contents may span lines
    ("<think></think><answer></answer>", {}, 1.0),  # empty blocks: only the layout is checked
    ("<think>a < b</think><answer>b > a</answer>", {}, 1.0),  # "<" and ">" that aren't tags are text
    ("Sure! <think>a</think><answer>b</answer>", {}, 0.0),  # strict: text before the think block
    ("<think>a</think> so <answer>b</answer>", {}, 0.0),  # strict: text between the blocks
    ("<think>a</think><answer>b</answer> done", {}, 0.0),  # strict: text after the answer block
    ("<answer>b</answer><think>a</think>", {}, 0.0),  # wrong order
    ("<think>a</think>", {}, 0.0),  # no answer block
    ("<answer>b</answer>", {}, 0.0),  # no think block
    ("b", {}, 0.0),  # no tags at all
    ("<think>a</think><think>b</think><answer>c</answer>", {}, 0.0),  # a repeated think block
    ("<think>a<answer>x</answer></think><answer>c</answer>", {}, 0.0),  # an answer nested in the think block
    ("<think>a</think><answer>b</answer><answer>c</answer>", {}, 0.0),  # two answer blocks
    ("<THINK>a</THINK><answer>b</answer>", {}, 0.0),  # tags are case-sensitive
    ("<think>a</think><answer>b", {}, 0.0),  # the answer block is never closed
    ("Sure! <think>a</think> so <answer>b</answer> done", LOOSE, 1.0),  # not strict: text around is fine
    ("<think>a</think><think>b</think><answer>c</answer>", LOOSE, 1.0),  # not strict: repeats are fine
    ("<answer>b</answer><think>a</think>", LOOSE, 0.0),  # not strict, but the order still matters
    ("<think>a</think> <answer>b", LOOSE, 0.0),  # not strict, but the answer block must close
    ("<think><answer>x</think></answer>", LOOSE, 0.0),  # "<answer>" before "</think>" doesn't count
    ("<reasoning>a</reasoning><final>b</final>", CUSTOM, 1.0),  # custom tag names
    ("<think>a</think><answer>b</answer>", CUSTOM, 0.0),  # with custom names the default tags don't count
]


@pytest.mark.parametrize(("completion", "options", "expected"), FORMAT_TABLE)
def test_format_table(completion, options, expected):
    assert think_answer_format(["Q"], [completion], **options) == [expected]


def test_format_batch_ignores_columns():
    strict_rows = [row for row in FORMAT_TABLE if not row[1]]
    n = len(strict_rows)
    got = think_answer_format(["Q"] * n, [row[0] for row in strict_rows], answer=["4"] * n)
    assert got == [row[2] for row in strict_rows]


@pytest.mark.parametrize("strict", [True, False])
def test_format_is_linear_on_long_tag_soup(strict):
    # 20k unmatched opening tags: a backtracking pattern would take minutes here.
    completion = "<think>" * 10_000 + "<answer>" * 10_000
    start = time.perf_counter()
    assert think_answer_format(["Q"], [completion], strict=strict) == [0.0]
    assert time.perf_counter() - start < 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"think_tag": ""}, "think_tag must be a tag name like 'think', got ''"),
        ({"answer_tag": "a>b"}, "answer_tag must be a tag name"),
        ({"think_tag": "answer"}, "think_tag and answer_tag are both 'answer'"),
    ],
)
def test_format_bad_tags(options, message):
    with pytest.raises(ValueError, match=message):
        think_answer_format(["Q"], ["x"], **options)


def test_format_misaligned():
    with pytest.raises(ValueError, match="1 prompts and 2 completions"):
        think_answer_format(["Q"], ["a", "b"])


# (completion, answer, expected with components "math:0.8,think_answer_format:0.2") — why.
WEIGHTED_TABLE = [
    ("<think>easy</think><answer>4</answer>", "4", 1.0),  # right answer (0.8) and the layout (0.2)
    ("4", "4", 0.8),  # right answer, no layout: 0.8 * 1 + 0.2 * 0
    ("<think>easy</think><answer>5</answer>", "4", 0.2),  # wrong answer in the layout: 0.2
    ("5", "4", 0.0),  # neither
]


@pytest.mark.parametrize(("completion", "answer", "expected"), WEIGHTED_TABLE)
def test_weighted_table(completion, answer, expected):
    got = weighted(["2+2="], [completion], answer=[answer], components="math:0.8,think_answer_format:0.2")
    assert got.rewards == [pytest.approx(expected)] and got.events == {}


def test_weighted_passes_options_and_allows_negative_weights():
    completion = "ok <think>x</think> <answer>4</answer>"  # only the loose layout
    loose = weighted(["Q"], [completion], answer=["4"], components="math:1,think_answer_format:-0.5", strict=False)
    strict = weighted(["Q"], [completion], answer=["4"], components="math:1,think_answer_format:-0.5")
    assert loose.rewards == [0.5]  # 1 * 1 - 0.5 * 1: strict=False reached think_answer_format
    assert strict.rewards == [1.0]  # 1 * 1 - 0.5 * 0


def test_weighted_merges_events_and_awaits_async_components(monkeypatch):
    def flaky(prompts, completions, **_):
        return Scored([1.0] * len(completions), {"timeout": 1, "sandbox_violation": 2})

    def also_flaky(prompts, completions, **_):
        return Scored([0.5] * len(completions), {"timeout": 2})

    async def judged(prompts, completions, **_):
        return [0.25] * len(completions)

    for name, fn in (("t_flaky", flaky), ("t_also_flaky", also_flaky), ("t_judged", judged)):
        monkeypatch.setitem(REWARDS._entries, name, fn)
    got = weighted(["Q", "Q"], ["a", "b"], components="t_flaky:1,t_also_flaky:2,t_judged:4")
    assert got.rewards == [3.0, 3.0]  # 1 * 1.0 + 2 * 0.5 + 4 * 0.25
    assert got.events == {"timeout": 3, "sandbox_violation": 2}  # summed by name


def test_weighted_rejects_a_component_returning_the_wrong_count(monkeypatch):
    monkeypatch.setitem(REWARDS._entries, "t_short", lambda prompts, completions, **_: [1.0])
    with pytest.raises(ValueError, match="component 't_short' returned 1 rewards for 2 completions"):
        weighted(["Q", "Q"], ["a", "b"], components="t_short:1")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "weighted needs components='name:weight,…'"),
        ("math", r"component 'math' in 'math' is not 'name:weight'"),
        ("math:abc", r"component 'math:abc' .* is not 'name:weight'"),
        ("math:nan", r"component 'math:nan' .* finite"),
        (":0.5", r"component ':0.5' .* is not 'name:weight'"),
        ("math:0.5,", r"component '' .* is not 'name:weight'"),
        ("nope:1", r"component 'nope' in 'nope:1' is not a registered reward; registered: .*math"),
        ("math:1,math:2", r"component 'math' appears twice"),
        ("weighted:1", "weighted cannot contain itself"),
    ],
)
def test_weighted_bad_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        weighted(["Q"], ["4"], answer=["4"], components=spec)


def test_parse_components():
    assert parse_components("math:1e-1, think_answer_format:2") == [("math", 0.1), ("think_answer_format", 2.0)]


def test_registered():
    assert get_reward("think_answer_format") is think_answer_format
    assert get_reward("weighted") is weighted


def test_docstring_examples():
    result = doctest.testmod(format_module)
    assert result.attempted > 0 and result.failed == 0
