import doctest
import json
import threading

import pytest

import engines.rewards.ifeval as ifeval_module
from engines.rewards import get_reward
from engines.rewards.ifeval import CHECKS, check_constraints, ifeval_reward

FIFTY_TWO_WORDS = " ".join(["word"] * 52)

# (response, constraint, whether it is met) — the comment says why.
TABLE = [
    ("one two three", {"type": "max_words", "value": 3}, True),  # 3 words = max 3: passes
    ("one two three four", {"type": "max_words", "value": 3}, False),  # 4 words > max 3: fails
    (FIFTY_TWO_WORDS, {"type": "max_words", "value": 50}, False),  # 52 words > max 50: fails
    ("don't stop", {"type": "max_words", "value": 2}, True),  # "don't" is one word, so 2 words
    ("well-known fact", {"type": "max_words", "value": 2}, False),  # a hyphen splits: well, known, fact = 3
    ("hi", {"type": "min_words", "value": 2}, False),  # 1 word < min 2: fails
    ("hi there, friend!", {"type": "min_words", "value": 3}, True),  # punctuation is not a word: 3 words
    ("", {"type": "min_words", "value": 0}, True),  # 0 words >= min 0
    ("It rains. We stay in!", {"type": "max_sentences", "value": 2}, True),  # 2 sentences = max 2
    ("One. Two. Three.", {"type": "max_sentences", "value": 2}, False),  # 3 sentences > max 2
    ("no end punctuation here", {"type": "min_sentences", "value": 1}, True),  # text without a stop is 1 sentence
    ("", {"type": "min_sentences", "value": 1}, False),  # no text, no sentence
    ("Pi is 3.14 or so.", {"type": "max_sentences", "value": 1}, True),  # a decimal point has no space after it
    ("Dr. Smith is here.", {"type": "max_sentences", "value": 1}, False),  # known limit: "Dr." ends a sentence
    ("The Tree is tall", {"type": "include_keywords", "value": ["tree"]}, True),  # keywords match in any case
    ("The trees are tall", {"type": "include_keywords", "value": ["tree"]}, False),  # whole words: trees is not tree
    ("a tree and a bird", {"type": "include_keywords", "value": ["tree", "bird"]}, True),  # both present
    ("a tree only", {"type": "include_keywords", "value": ["tree", "bird"]}, False),  # bird missing
    ("a tree", {"type": "include_keywords", "value": "tree"}, True),  # one keyword may be a plain string
    ("C++ is fun", {"type": "include_keywords", "value": "C++"}, True),  # regex characters are matched literally
    ("a cold day", {"type": "exclude_keywords", "value": ["cold", "snow"]}, False),  # cold appears
    ("its coldness", {"type": "exclude_keywords", "value": "cold"}, True),  # coldness is not the word cold
    ("SNOW everywhere", {"type": "exclude_keywords", "value": ["snow"]}, False),  # any case
    ('{"a": 1}', {"type": "json_format"}, True),  # a JSON object
    (' \n{"a": [1, 2]}\n', {"type": "json_format"}, True),  # surrounding whitespace is fine
    ('```json\n{"a": 1}\n```', {"type": "json_format"}, True),  # a ```json fence is allowed
    ("```\n[1, 2]\n```", {"type": "json_format"}, True),  # and a bare ``` fence
    ('Here you go: {"a": 1}', {"type": "json_format"}, False),  # text before the JSON
    ("{'a': 1}", {"type": "json_format"}, False),  # single quotes are Python, not JSON
    ("", {"type": "json_format"}, False),  # nothing is not JSON
    ("all lower, 123!", {"type": "lowercase"}, True),  # digits and punctuation have no case
    ("Not lower", {"type": "lowercase"}, False),  # a capital N
    ("123", {"type": "lowercase"}, False),  # no letters at all: str.islower is False
    ("ALL CAPS, 42!", {"type": "uppercase"}, True),  # every letter uppercase
    ("ALL CAPs", {"type": "uppercase"}, False),  # one lowercase s
    ("* a\n* b\n- c", {"type": "bullet_count", "value": 3}, True),  # "* " and "- " both count: 3
    ("* a\n* b", {"type": "bullet_count", "value": 3}, False),  # 2 bullets, not exactly 3
    ("* a\n* b\n* c\n* d", {"type": "bullet_count", "value": 3}, False),  # 4 bullets, not exactly 3
    ("*a\n* b", {"type": "bullet_count", "value": 1}, True),  # "*a" has no space: not a bullet
    ("  - nested\n- top", {"type": "bullet_count", "value": 2}, True),  # indentation is allowed
    ("**bold** text\n* a", {"type": "bullet_count", "value": 1}, True),  # "**bold**" is not "* "
    ("  Dear friend, hi", {"type": "starts_with", "value": "dear friend"}, True),  # leading space and case ignored
    ("Hi, dear friend", {"type": "starts_with", "value": "Dear friend"}, False),  # the phrase is not first
    ("Bye. See you soon.\n", {"type": "ends_with", "value": "See you soon."}, True),  # trailing newline stripped
    ("See you soon!", {"type": "ends_with", "value": "See you soon."}, False),  # "!" is not "."
    ("a\n\nb", {"type": "paragraph_count", "value": 2}, True),  # one blank line: 2 paragraphs
    ("a\nb", {"type": "paragraph_count", "value": 2}, False),  # a single newline keeps 1 paragraph
    ("a\n \n\nb\n\n", {"type": "paragraph_count", "value": 2}, True),  # whitespace-only lines are blank
    ("a\n\nb\n\nc", {"type": "paragraph_count", "value": 2}, False),  # 3 paragraphs, not exactly 2
    ("no commas here", {"type": "no_commas"}, True),  # no ","
    ("a, b", {"type": "no_commas"}, False),  # one ","
    ("[name] at [place]", {"type": "min_placeholders", "value": 2}, True),  # 2 placeholders >= 2
    ("Dear [name]", {"type": "min_placeholders", "value": 2}, False),  # 1 placeholder < 2
    ("[] and [\n]", {"type": "min_placeholders", "value": 1}, False),  # empty or multi-line brackets don't count
    ("Le chat dort sur le canapé toute la journée.", {"type": "language", "value": "fr"}, True),  # French
    ("The cat sleeps on the sofa all day long.", {"type": "language", "value": "fr"}, False),  # English, not French
    ("The cat sleeps on the sofa all day long.", {"type": "language", "value": "EN"}, True),  # any case of code
    ("12345", {"type": "language", "value": "en"}, False),  # no letters: langdetect gives up, not met
]


@pytest.mark.parametrize(("response", "constraint", "met"), TABLE)
def test_check_table(response, constraint, met):
    assert check_constraints(response, [constraint]) == [met]


def test_every_check_is_in_the_table_and_the_docstring():
    assert {constraint["type"] for _, constraint, _ in TABLE} == set(CHECKS.names())
    assert all(f"\n{name} " in ifeval_module.__doc__ for name in CHECKS.names())


# (completion, constraints, mode, expected reward) — the comment says why.
REWARD_TABLE = [
    ("short and lower", [{"type": "max_words", "value": 5}, {"type": "lowercase"}], "fraction", 1.0),  # both met
    ("Short and not lower", [{"type": "max_words", "value": 5}, {"type": "lowercase"}], "fraction", 0.5),  # 1 of 2
    ("Short and not lower", [{"type": "max_words", "value": 5}, {"type": "lowercase"}], "all", 0.0),  # not all met
    ("short and lower", [{"type": "max_words", "value": 5}, {"type": "lowercase"}], "all", 1.0),  # all met
    (
        "Way, way too long for this",
        [{"type": "max_words", "value": 5}, {"type": "lowercase"}, {"type": "no_commas"}],
        "fraction",
        0.0,
    ),  # 6 words, a capital W and a comma: 0 of 3
    ("a, b", [{"type": "lowercase"}, {"type": "no_commas"}, {"type": "max_words", "value": 9}], "fraction", 2 / 3),
    # lowercase and 2 words are fine, the comma is not: 2 of 3
]


@pytest.mark.parametrize(("completion", "constraints", "mode", "expected"), REWARD_TABLE)
def test_reward_table(completion, constraints, mode, expected):
    assert ifeval_reward(["Q"], [completion], constraints=[constraints], mode=mode) == [pytest.approx(expected)]


def test_batch_with_json_string_constraints_and_extra_columns():
    rules = [{"type": "max_words", "value": 3}, {"type": "ends_with", "value": "bye"}]
    got = ifeval_reward(
        ["Q"] * 3,
        ["ok bye", "ok ok ok bye", "hello"],
        constraints=[rules, json.dumps(rules), json.dumps(rules)],
        answer=["x"] * 3,
    )
    assert got == [1.0, 0.5, 0.5]  # both met; 4 words > 3; doesn't end with bye


def test_value_none_counts_as_no_value():
    # ``datasets`` may fill a missing "value" with None when it infers one struct for every constraint.
    assert check_constraints("abc", [{"type": "lowercase", "value": None}]) == [True]


@pytest.mark.parametrize(
    ("constraints", "message"),
    [
        ([{"type": "max_chars", "value": 9}], "unknown ifeval constraint type 'max_chars'; known: .*max_words"),
        ([{"type": "max_words"}], "'max_words' needs a non-negative int 'value', got no value"),
        ([{"type": "max_words", "value": "50"}], "'max_words' needs a non-negative int 'value', got '50'"),
        ([{"type": "max_words", "value": True}], "needs a non-negative int"),
        ([{"type": "max_words", "value": -1}], "needs a non-negative int"),
        ([{"type": "include_keywords", "value": []}], "'include_keywords' needs a keyword or a list of keywords"),
        ([{"type": "starts_with", "value": "  "}], "'starts_with' needs a non-empty string"),
        ([{"type": "max_words", "vaule": 5}], r"unknown keys \['vaule'\]"),
        ([{"value": 5}], "must be a dict with a 'type'"),
        ([], "non-empty list"),
        ("not json", "Expecting value"),
    ],
)
def test_malformed_constraints_raise(constraints, message):
    with pytest.raises(ValueError, match=message):
        ifeval_reward(["Q"], ["text"], constraints=[constraints])


def test_bad_mode_and_misaligned_lists():
    with pytest.raises(ValueError, match="mode must be 'fraction' or 'all', got 'any'"):
        ifeval_reward(["Q"], ["x"], constraints=[[{"type": "lowercase"}]], mode="any")
    with pytest.raises(ValueError, match="1 prompts, 2 completions and 1 constraint lists"):
        ifeval_reward(["Q"], ["x", "y"], constraints=[[{"type": "lowercase"}]])


def test_language_is_deterministic_across_threads():
    # langdetect samples at random; with the fixed seed every thread gets the same answers.
    texts = ["Ciao, come stai oggi?", "Hola, ¿cómo estás hoy?", "Hallo, wie geht es dir heute?"]
    rules = [[{"type": "language", "value": code}] for code in ("it", "es", "de")]
    results = []
    threads = [threading.Thread(target=lambda: results.append(ifeval_reward(["Q"] * 3, texts, constraints=rules)))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results == [[1.0, 1.0, 1.0]] * 4


def test_registered():
    assert get_reward("ifeval") is ifeval_reward


def test_docstring_examples():
    result = doctest.testmod(ifeval_module)
    assert result.attempted > 0 and result.failed == 0
