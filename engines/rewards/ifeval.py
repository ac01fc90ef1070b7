"""``ifeval``: the share of a row's verifiable instructions that a completion follows (IFEval-style).

Instruction-following constraints in the spirit of IFEval (Zhou et al. 2023, "Instruction-Following
Evaluation for Large Language Models", arXiv:2311.07911): each is checked by a small pure function of
the response text, with no model in the loop. A row's ``constraints`` column is a list (or a JSON
string of a list) of ``{"type": <check name>, "value": <its parameter>}``; checks without a parameter
(``lowercase``, ``json_format``, …) take no ``value``. The checks:

===================  ==================  ==============================================================
type                 value               passes when
===================  ==================  ==============================================================
min_words            int                 at least ``value`` words (a word: ``\\w+``, ``don't`` is one)
max_words            int                 at most ``value`` words
min_sentences        int                 at least ``value`` sentences (split after ``.``, ``!``, ``?``)
max_sentences        int                 at most ``value`` sentences
include_keywords     str or list[str]    every keyword appears (whole word, any case)
exclude_keywords     str or list[str]    no keyword appears (whole word, any case)
json_format          —                   the whole response is JSON (a ```` ```json ```` fence allowed)
lowercase            —                   every letter is lowercase (and there is one)
uppercase            —                   every letter is uppercase (and there is one)
bullet_count         int                 exactly ``value`` lines start with ``* `` or ``- ``
starts_with          str                 the stripped response starts with the phrase (any case)
ends_with            str                 the stripped response ends with the phrase (any case)
paragraph_count      int                 exactly ``value`` paragraphs, separated by blank lines
no_commas            —                   no ``,`` anywhere
min_placeholders     int                 at least ``value`` square-bracket placeholders like ``[name]``
language             str (ISO 639-1)     langdetect names that language (``"en"``, ``"fr"``, …)
===================  ==================  ==============================================================

Written here rather than taken from a package: Google's reference checks ship inside lm-eval
(``lm_eval.tasks.ifeval``, a heavy install), and the small standalone ports on PyPI need nltk's punkt
data downloaded at run time, which a training node without a network cannot do. The checks follow
IFEval's where one exists (case-insensitive start/end phrases, ``str.islower`` for lowercase, langdetect
for language) and are simpler in two places: sentences split on end punctuation (so ``Dr. Smith`` makes
two), and paragraphs split on blank lines rather than IFEval's ``***``.

``mode="fraction"`` (default) scores the fraction of a row's constraints met, IFEval's loose
"instruction-level" accuracy as a dense reward; ``mode="all"`` scores 1.0 only when every one is met
(IFEval's "prompt-level" accuracy). An unknown constraint type, a missing or ill-typed ``value``, or a
row without constraints raises ``ValueError``: that is a dataset bug, which the scoring runner counts.

Language detection uses langdetect with ``DetectorFactory.seed = 0``, so it is deterministic; its first
call in a process loads the language profiles (~0.2 s), the other checks take microseconds.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any, Callable, Literal

from langdetect import DetectorFactory, LangDetectException, detect
from langdetect import detector_factory

from engines.registry import Registry
from engines.rewards import REWARDS

DetectorFactory.seed = 0  # langdetect samples n-grams at random; a fixed seed makes it deterministic

Check = Callable[[str, Any], bool]  # (response, value) -> whether the response meets the constraint
CHECKS: Registry[Check] = Registry("ifeval constraint")
_NO_VALUE = object()  # the ``value`` a check gets when its constraint has none

_WORD = re.compile(r"\w+(?:['’]\w+)*")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_BLANK_LINE = re.compile(r"\n\s*\n")
_PLACEHOLDER = re.compile(r"\[[^\[\]\n]+\]")
_JSON_FENCE = re.compile(r"^```(?:json)?\s*\n?(.*?)\n?```$", re.DOTALL | re.IGNORECASE)
_LANGDETECT_LOCK = threading.Lock()


@REWARDS.register("ifeval")
def ifeval_reward(
    prompts: list[str],
    completions: list[str],
    *,
    constraints: list[list[dict] | str],
    mode: Literal["fraction", "all"] = "fraction",  # "fraction": share of constraints met; "all": 1.0 only if all are
    **_: Any,
) -> list[float]:
    """Per completion, the fraction of its row's ``constraints`` met (``mode="all"``: 1.0 or 0.0).

    >>> rules = [{"type": "max_words", "value": 5}, {"type": "lowercase"}]
    >>> ifeval_reward(["Q", "Q", "Q"], ["all good here", "All good here", "one two three four five six"],
    ...               constraints=[rules] * 3)
    [1.0, 0.5, 0.5]
    >>> ifeval_reward(["Q"], ["All good here"], constraints=['[{"type": "lowercase"}, {"type": "no_commas"}]'],
    ...               mode="all")
    [0.0]
    """
    if mode not in ("fraction", "all"):
        raise ValueError(f"ifeval mode must be 'fraction' or 'all', got {mode!r}")
    if not len(prompts) == len(completions) == len(constraints):
        raise ValueError(
            f"ifeval_reward needs aligned lists; got {len(prompts)} prompts, {len(completions)} completions "
            f"and {len(constraints)} constraint lists"
        )
    rewards = []
    for completion, row_constraints in zip(completions, constraints):
        met = check_constraints(completion, row_constraints)
        rewards.append(float(all(met)) if mode == "all" else sum(met) / len(met))
    return rewards


def check_constraints(response: str, constraints: list[dict] | str) -> list[bool]:
    """Whether ``response`` meets each constraint, in order; ``ValueError`` on a malformed constraint.

    >>> check_constraints("Hello, world.", [{"type": "no_commas"}, {"type": "ends_with", "value": "WORLD."}])
    [False, True]
    """
    if isinstance(constraints, str):
        constraints = json.loads(constraints)
    if not isinstance(constraints, list) or not constraints:
        raise ValueError(f"ifeval constraints must be a non-empty list of dicts, got {constraints!r}")
    return [_check_one(response, constraint) for constraint in constraints]


def _check_one(response: str, constraint: dict) -> bool:
    if not isinstance(constraint, dict) or "type" not in constraint:
        raise ValueError(f"an ifeval constraint must be a dict with a 'type', got {constraint!r}")
    # Columns loaded through ``datasets`` may carry "value": None for checks that take none.
    extra = sorted(k for k, v in constraint.items() if k not in ("type", "value") and v is not None)
    if extra:
        raise ValueError(f"ifeval constraint {constraint!r} has unknown keys {extra}; use 'type' and 'value'")
    kind = constraint["type"]
    if kind not in CHECKS:
        raise ValueError(f"unknown ifeval constraint type {kind!r}; known: {', '.join(CHECKS.names())}")
    value = constraint.get("value")
    return bool(CHECKS.get(kind)(response, _NO_VALUE if value is None else value))


# -- value parsing: a bad value is a dataset bug, so it raises ------------------------------------------


def _count(value: Any, kind: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"ifeval constraint {kind!r} needs a non-negative int 'value', got {_show(value)}")
    return value


def _phrase(value: Any, kind: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"ifeval constraint {kind!r} needs a non-empty string 'value', got {_show(value)}")
    return value.strip()


def _keywords(value: Any, kind: str) -> list[str]:
    words = [value] if isinstance(value, str) else value
    if not isinstance(words, list) or not words or not all(isinstance(w, str) and w.strip() for w in words):
        raise ValueError(f"ifeval constraint {kind!r} needs a keyword or a list of keywords, got {_show(value)}")
    return [w.strip() for w in words]


def _show(value: Any) -> str:
    return "no value" if value is _NO_VALUE else repr(value)


def _has_keyword(text: str, keyword: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(keyword)}(?!\w)", text, re.IGNORECASE) is not None


def _words(text: str) -> int:
    return len(_WORD.findall(text))


def _sentences(text: str) -> int:
    return sum(1 for piece in _SENTENCE_END.split(text.strip()) if re.search(r"\w", piece))


def _paragraphs(text: str) -> int:
    return sum(1 for piece in _BLANK_LINE.split(text) if piece.strip())


# -- the checks ---------------------------------------------------------------------------------------


@CHECKS.register("min_words")
def min_words(response: str, value: Any) -> bool:
    return _words(response) >= _count(value, "min_words")


@CHECKS.register("max_words")
def max_words(response: str, value: Any) -> bool:
    return _words(response) <= _count(value, "max_words")


@CHECKS.register("min_sentences")
def min_sentences(response: str, value: Any) -> bool:
    return _sentences(response) >= _count(value, "min_sentences")


@CHECKS.register("max_sentences")
def max_sentences(response: str, value: Any) -> bool:
    return _sentences(response) <= _count(value, "max_sentences")


@CHECKS.register("include_keywords")
def include_keywords(response: str, value: Any) -> bool:
    return all(_has_keyword(response, word) for word in _keywords(value, "include_keywords"))


@CHECKS.register("exclude_keywords")
def exclude_keywords(response: str, value: Any) -> bool:
    return not any(_has_keyword(response, word) for word in _keywords(value, "exclude_keywords"))


@CHECKS.register("json_format")
def json_format(response: str, value: Any) -> bool:
    text = response.strip()
    fenced = _JSON_FENCE.match(text)
    try:
        json.loads(fenced.group(1) if fenced else text)
    except ValueError:  # json.JSONDecodeError is a ValueError
        return False
    return True


@CHECKS.register("lowercase")
def lowercase(response: str, value: Any) -> bool:
    return response.islower()


@CHECKS.register("uppercase")
def uppercase(response: str, value: Any) -> bool:
    return response.isupper()


@CHECKS.register("bullet_count")
def bullet_count(response: str, value: Any) -> bool:
    bullets = sum(1 for line in response.splitlines() if line.lstrip().startswith(("* ", "- ")))
    return bullets == _count(value, "bullet_count")


@CHECKS.register("starts_with")
def starts_with(response: str, value: Any) -> bool:
    return response.strip().lower().startswith(_phrase(value, "starts_with").lower())


@CHECKS.register("ends_with")
def ends_with(response: str, value: Any) -> bool:
    return response.strip().lower().endswith(_phrase(value, "ends_with").lower())


@CHECKS.register("paragraph_count")
def paragraph_count(response: str, value: Any) -> bool:
    return _paragraphs(response) == _count(value, "paragraph_count")


@CHECKS.register("no_commas")
def no_commas(response: str, value: Any) -> bool:
    return "," not in response


@CHECKS.register("min_placeholders")
def min_placeholders(response: str, value: Any) -> bool:
    return len(_PLACEHOLDER.findall(response)) >= _count(value, "min_placeholders")


@CHECKS.register("language")
def language(response: str, value: Any) -> bool:
    code = _phrase(value, "language").lower()
    with _LANGDETECT_LOCK:  # the first call loads the shared profiles; don't let two threads race it
        detector_factory.init_factory()
    try:
        return detect(response) == code
    except LangDetectException:  # no letters to go on ("12345", "")
        return False
