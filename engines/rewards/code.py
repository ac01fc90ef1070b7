"""``code``: the fraction of a row's tests that the Python code in a completion passes, run in the sandbox.

**Code** is the last fenced block tagged ``python``/``py``/``python3`` in the completion, else the last
fenced block of any language, else the whole completion when it parses as Python and is more than bare
names and constants ("Yes", "42", "I don't know." count as prose). An unclosed final fence (a completion
cut off by the token limit) runs to the end of the text. No code: 0.0 and a ``no_code`` event.

**Tests** are the row's ``tests`` column, a list (or its JSON string) of cases, each either
* ``{"input": str, "output": str}``: the code runs as a program with ``input`` on stdin and passes when it
  exits 0 and its stdout equals ``output`` after stripping both ends and the end of every line; or
* an assert string such as ``"assert add(1, 2) == 3"``: the code runs with ``__name__ != "__main__"``
  (so its ``if __name__ == "__main__":`` block does not read stdin), then the asserts, then a print of
  a random nonce; it passes when it exits 0 with the nonce as its last line, so a solution that ends
  the process early (``sys.exit(0)``, ``os._exit(0)``) before the asserts does not pass.

Every test is one ``engines.rewards.sandbox.run_python`` process (``wall_s`` wall clock, the same CPU
time, ``memory_mb``; no network, no writes outside its temp dir, see that module), at most
``min(4, CPUs)`` at once in a pool shared by the process. A completion with a syntax error is not run.
The sandbox's kernel layers need root or unprivileged user namespaces; where neither is available a
config with this reward is refused unless ``reward.allow_unsandboxed_code`` is true.

    reward = passed / len(tests)                       (mode="pass_fraction")
    reward = 1.0 if passed == len(tests) else 0.0      (mode="all_pass"; its other tests stop at a failure)

Events, each counted once per completion that had it on any test: ``timeout``, ``memory``,
``violation``, ``output_limit``, ``error`` (an exception other than a failed assert, a non-zero exit, a
syntax error), ``no_code``.

Time: tens of milliseconds per test (the interpreter start dominates), ``wall_s`` for one that
hangs; a call costs about ``ceil(completions * tests / workers) * per-test time``, which the domain's
``timeout_s`` must cover. Known hole: an assert ``f(x) == y`` passes when ``f`` returns an object whose
``__eq__`` always says True; stdin/stdout tests compare text and are not fooled that way.

>>> solution = "```python\\ndef add(a, b):\\n    return a + b\\n```"
>>> code_reward(["Write add."], [solution], tests=[["assert add(1, 2) == 3", "assert add(2, 2) == 5"]])
Scored(rewards=[0.5], events={})
>>> echo = "```python\\nprint(input()[::-1])\\n```"
>>> code_reward(["Reverse."] * 2, [echo, "I cannot help."], tests=[[{"input": "abc", "output": "cba"}]] * 2)
Scored(rewards=[1.0, 0.0], events={'no_code': 1})
"""

from __future__ import annotations

import ast
import concurrent.futures as futures
import json
import os
import re
import secrets
import threading
from typing import Any, Literal

from engines.rewards import REWARDS, Scored
from engines.rewards.sandbox import run_python

MODES = ("pass_fraction", "all_pass")
EVENTS = ("timeout", "memory", "violation", "output_limit", "error", "no_code")
_PYTHON_TAGS = {"python", "py", "python3", "py3"}
_FENCE = re.compile(r"```[ \t]*([^\n`]*)\n(.*?)(?:```|\Z)", re.DOTALL)
_WORKERS = max(1, min(4, os.cpu_count() or 1))  # sandboxes at once per process: each is a busy interpreter

_pool_lock = threading.Lock()
_pool: list[futures.ThreadPoolExecutor] = []


@REWARDS.register("code")
def code_reward(prompts: list[str], completions: list[str], *, tests: list,
                mode: Literal["pass_fraction", "all_pass"] = "pass_fraction", wall_s: float = 5.0, memory_mb: int = 256,
                **_: Any) -> Scored:
    """Per completion, the fraction of its row's ``tests`` passed (``all_pass``: 1.0 only if all pass).

    ``mode``: ``pass_fraction`` | ``all_pass``; ``wall_s``: wall-clock and CPU-time limit of each test's
    process; ``memory_mb``: its address-space limit. See the module docstring for the formats.
    """
    if mode not in MODES:
        raise ValueError(f"code_reward mode {mode!r} is not one of {', '.join(MODES)}")
    if not len(prompts) == len(completions) == len(tests):
        raise ValueError(f"code_reward needs aligned lists; got {len(prompts)} prompts, {len(completions)} "
                         f"completions and {len(tests)} test lists")
    cases = [_parse_tests(row, i) for i, row in enumerate(tests)]
    passed = [0] * len(completions)
    seen: list[set[str]] = [set() for _ in completions]
    jobs: dict[futures.Future, int] = {}
    by_completion: list[list[futures.Future]] = [[] for _ in completions]
    for i, completion in enumerate(completions):
        code = extract_code(completion)
        if code is None:
            seen[i].add("no_code")
            continue
        try:
            ast.parse(code)  # not compile(): its SyntaxWarnings ("is" with a literal) would land in our log
        except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: a NUL byte
            seen[i].add("error")
            continue
        for case in cases[i]:
            job = _executor().submit(_run_case, code, case, wall_s, memory_mb)
            jobs[job] = i
            by_completion[i].append(job)
    try:
        for job in futures.as_completed(jobs):
            if job.cancelled():
                continue
            i = jobs[job]
            ok, status = job.result()
            passed[i] += ok
            if status != "ok":
                seen[i].add(status)
            if not ok and mode == "all_pass":
                for other in by_completion[i]:
                    other.cancel()  # a failed test decides all_pass: skip the ones not started yet
    finally:
        for job in jobs:
            job.cancel()
    if mode == "pass_fraction":
        rewards = [n / len(rows) for n, rows in zip(passed, cases)]
    else:
        rewards = [float(n == len(rows)) for n, rows in zip(passed, cases)]
    events = {name: sum(name in s for s in seen) for name in EVENTS}
    return Scored(rewards, {name: n for name, n in events.items() if n})


code_reward.runs_model_code = True  # the config refuses it where the sandbox has no kernel isolation (configs.schema)


def extract_code(completion: str) -> str | None:
    """The code to run from a completion (see the module docstring), or None when it holds none."""
    blocks = [(tag.strip().split(" ")[0].lower(), body) for tag, body in _FENCE.findall(completion)]
    if blocks:
        python = [body for tag, body in blocks if tag in _PYTHON_TAGS]
        code = (python or [body for _, body in blocks])[-1]
        return code if code.strip() else None
    try:
        tree = ast.parse(completion)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    prose = all(isinstance(node, ast.Expr) and isinstance(node.value, (ast.Name, ast.Constant)) for node in tree.body)
    return None if prose else completion


def _parse_tests(row: Any, index: int) -> list:
    if isinstance(row, str):
        row = json.loads(row)
    if not isinstance(row, (list, tuple)) or not row:
        raise ValueError(f"row {index}: tests must be a non-empty list (or its JSON), got {str(row)[:80]!r}")
    for case in row:
        if isinstance(case, dict) and {"input", "output"} <= set(case):
            continue
        if isinstance(case, str) and case.strip():
            continue
        raise ValueError(f'row {index}: a test is {{"input": str, "output": str}} or an assert string, got '
                         f"{str(case)[:80]!r}")
    return list(row)


def _run_case(code: str, case: dict | str, wall_s: float, memory_mb: int) -> tuple[bool, str]:
    """(passed, sandbox status) of one test."""
    limits = {"wall_s": wall_s, "cpu_s": wall_s, "memory_mb": memory_mb}
    if isinstance(case, dict):
        result = run_python(code, stdin=str(case["input"]), **limits)
        return result.status == "ok" and _normalize(result.stdout) == _normalize(str(case["output"])), result.status
    nonce = secrets.token_hex(16)
    # exec keeps a `from __future__` import of the solution legal (it must open its compile unit)
    program = (f'__name__ = "solution"\nexec(compile({code!r}, "<solution>", "exec"), globals())\n'
               f'__name__ = "__main__"\n{case}\nprint("\\n" + {nonce!r})\n')
    result = run_python(program, **limits)
    if result.status == "error" and result.stderr.rstrip().rsplit("\n", 1)[-1].startswith("AssertionError"):
        return False, "ok"  # a failed assert is a wrong answer, not an error
    return result.status == "ok" and result.stdout.rstrip("\n").rsplit("\n", 1)[-1] == nonce, result.status


def _normalize(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _executor() -> futures.ThreadPoolExecutor:
    with _pool_lock:
        if not _pool:
            _pool.append(futures.ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="code-sandbox"))
        return _pool[0]
