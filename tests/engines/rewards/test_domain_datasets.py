"""The sample datasets under configs/data: they load, their references are right, reasoning regenerates."""

import concurrent.futures as futures
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from engines.data.prompts import load_prompt_rows
from engines.rewards.ifeval import CHECKS, check_constraints

DATA = Path(__file__).resolve().parents[3] / "configs" / "data"
DOMAINS = ["math", "code", "ifeval", "reasoning", "qa"]
SIZES = {"train": range(24, 41), "heldout": range(8, 13)}
MAX_PROMPT_CHARS = 200
FILES = [(domain, split) for domain in DOMAINS for split in SIZES]


def rows_of(domain: str, split: str) -> list[dict]:
    return load_prompt_rows(str(DATA / domain / f"{split}.jsonl"))


@pytest.mark.parametrize(("domain", "split"), FILES)
def test_file_loads_with_prompts_and_answers(domain, split):
    rows = rows_of(domain, split)
    assert len(rows) in SIZES[split]
    for row in rows:
        assert isinstance(row["prompt"], str) and row["prompt"].strip()
        assert isinstance(row["answer"], str) and row["answer"].strip()
        assert len(row["prompt"]) < MAX_PROMPT_CHARS, row["prompt"]
    assert len({row["prompt"] for row in rows}) == len(rows), "a prompt appears twice"


@pytest.mark.parametrize("domain", DOMAINS)
def test_heldout_prompts_are_not_in_train(domain):
    train = {row["prompt"] for row in rows_of(domain, "train")}
    assert not train & {row["prompt"] for row in rows_of(domain, "heldout")}


@pytest.mark.parametrize("split", SIZES)
def test_math_answers_are_integers(split):
    for row in rows_of("math", split):
        int(row["answer"])


def _run(code: str, stdin: str = "") -> subprocess.CompletedProcess:
    # -I -S: isolated and without site-packages, which also starts faster; references use the stdlib only.
    return subprocess.run([sys.executable, "-I", "-S", "-c", code], input=stdin, capture_output=True, text=True,
                          timeout=20)


def _failures(row: dict) -> list[str]:
    """What goes wrong when running the row's reference against its tests (empty: all pass)."""
    tests = row["tests"]
    if all(isinstance(test, str) for test in tests):  # assert statements, run after the reference
        done = _run(row["answer"] + "\n" + "\n".join(tests) + "\n")
        return [] if done.returncode == 0 else [done.stderr.strip().splitlines()[-1]]
    problems = []
    for test in tests:  # stdin/stdout cases: the reference is a program
        done = _run(row["answer"], test["input"])
        if done.returncode != 0 or done.stdout != test["output"]:
            problems.append(f"input {test['input']!r}: got {done.stdout!r} (rc {done.returncode}), "
                            f"want {test['output']!r}")
    return problems


@pytest.mark.parametrize("split", SIZES)
def test_code_references_pass_their_tests(split):
    rows = rows_of("code", split)
    for row in rows:  # each test is an assert string or an input/output case, and can fail
        assert len(row["tests"]) >= 2, row["prompt"]
        for test in row["tests"]:
            if isinstance(test, str):
                assert test.startswith("assert "), test
            else:
                assert set(test) == {"input", "output"} and test["output"], test
    with futures.ThreadPoolExecutor(max_workers=4) as pool:
        failures = {row["prompt"]: problems for row, problems in zip(rows, pool.map(_failures, rows)) if problems}
    assert failures == {}


@pytest.mark.parametrize("split", SIZES)
def test_ifeval_example_answers_meet_their_constraints(split):
    for row in rows_of("ifeval", split):
        assert all(constraint["type"] in CHECKS for constraint in row["constraints"])
        assert all(check_constraints(row["answer"], row["constraints"])), row["prompt"]


def test_ifeval_files_use_every_check():
    used = {c["type"] for split in SIZES for row in rows_of("ifeval", split) for c in row["constraints"]}
    assert used == set(CHECKS.names())


def test_reasoning_files_are_what_make_reasoning_writes():
    spec = importlib.util.spec_from_file_location("make_reasoning", DATA / "make_reasoning.py")
    make_reasoning = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_reasoning)
    for split, rows in make_reasoning.build().items():
        assert (DATA / "reasoning" / f"{split}.jsonl").read_text(encoding="utf-8") == make_reasoning.render(rows)
    assert make_reasoning.main(["--check"]) == 0
