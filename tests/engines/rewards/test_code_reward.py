import doctest
import json
import time

import pytest

import engines.rewards.code as code_module
from engines.rewards import Scored, get_reward, reward_names
from engines.rewards.code import code_reward, extract_code


def fenced(body: str, tag: str = "python") -> str:
    return f"Here is my solution:\n```{tag}\n{body}\n```\nIt runs in O(n)."


ADD = "def add(a, b):\n    return a + b"
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-4, 4) == 0"]
SUM_IO = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 7\n", "output": "12"}]  # ends with/without \n
DOUBLE_IO = [{"input": "2\n", "output": "4"}, {"input": "3\n", "output": "6"}]

# (completion, tests, mode, expected reward, expected events) — the comment says why.
TABLE = [
    # stdin/stdout program, both outputs right (the trailing newline of one expected output is stripped).
    (fenced("a, b = map(int, input().split())\nprint(a + b)"), SUM_IO, "pass_fraction", 1.0, {}),
    # The same program under all_pass: everything passes, so 1.0 there too.
    (fenced("a, b = map(int, input().split())\nprint(a + b)"), SUM_IO, "all_pass", 1.0, {}),
    # x * x is right for 2 (4) and wrong for 3 (9 != 6): half the tests.
    (fenced("x = int(input())\nprint(x * x)"), DOUBLE_IO, "pass_fraction", 0.5, {}),
    # ... and all_pass gives nothing for half.
    (fenced("x = int(input())\nprint(x * x)"), DOUBLE_IO, "all_pass", 0.0, {}),
    # Trailing spaces and \r\n line ends are ignored line by line.
    (fenced("print('1  \\r\\n2 ')"), [{"input": "", "output": "1\n2"}], "pass_fraction", 1.0, {}),
    # Assert-style tests: the function is right on both.
    (fenced(ADD), ADD_TESTS, "pass_fraction", 1.0, {}),
    # a - b: add(1, 2) is -1 and add(-4, 4) is -8, both wrong; a failed assert is a wrong answer, not an error.
    (fenced("def add(a, b):\n    return a - b"), ADD_TESTS, "pass_fraction", 0.0, {}),
    # a * b + 1: add(1, 2) == 3 passes, add(-4, 4) == -15 fails.
    (fenced("def add(a, b):\n    return a * b + 1"), ADD_TESTS, "pass_fraction", 0.5, {}),
    # The __main__ block reads stdin; under assert tests it does not run, so it cannot crash them.
    (fenced(ADD + "\n\nif __name__ == '__main__':\n    print(add(*map(int, input().split())))"), ADD_TESTS,
     "pass_fraction", 1.0, {}),
    # A `from __future__` import must open the file; it still works ahead of the tests.
    (fenced("from __future__ import annotations\n" + ADD), ADD_TESTS, "pass_fraction", 1.0, {}),
    # Leaving early with exit code 0 skips the asserts: no credit (the end-of-tests nonce never prints).
    (fenced("import sys\nsys.exit(0)"), ADD_TESTS, "pass_fraction", 0.0, {}),
    (fenced("import os\nos._exit(0)"), ADD_TESTS, "pass_fraction", 0.0, {}),
    # Syntax error: 0.0 and an error event, without running anything.
    (fenced("def add(a, b)\n    return a + b"), ADD_TESTS, "pass_fraction", 0.0, {"error": 1}),
    # A runtime exception on every test: error, counted once for the completion.
    (fenced("def add(a, b):\n    return a + undefined"), ADD_TESTS, "pass_fraction", 0.0, {"error": 1}),
    # Infinite loop: killed at wall_s, a timeout.
    (fenced("while True:\n    pass"), [{"input": "", "output": ""}], "pass_fraction", 0.0, {"timeout": 1}),
    # A huge allocation hits RLIMIT_AS: memory.
    (fenced("x = bytearray(10**10)"), [{"input": "", "output": ""}], "pass_fraction", 0.0, {"memory": 1}),
    # Printing forever: output_limit.
    (fenced("while True:\n    print('spam')"), [{"input": "", "output": "spam"}], "pass_fraction", 0.0,
     {"output_limit": 1}),
    # No fence, but the whole completion is Python: it runs as is.
    (ADD, ADD_TESTS, "pass_fraction", 1.0, {}),
    # Prose without code: no_code.
    ("I am not sure how to solve this problem, sorry.", ADD_TESTS, "pass_fraction", 0.0, {"no_code": 1}),
    # A one-word answer parses as a Python name but is prose, not code.
    ("Yes", ADD_TESTS, "pass_fraction", 0.0, {"no_code": 1}),
    # An empty fenced block holds no code.
    (fenced(""), ADD_TESTS, "pass_fraction", 0.0, {"no_code": 1}),
    # A socket connection is a sandbox violation, whatever it would have printed.
    (fenced("import socket\nsocket.create_connection(('127.0.0.1', 80))\nprint(3)"), [{"input": "", "output": "3"}],
     "pass_fraction", 0.0, {"violation": 1}),
    # Writing outside its temp dir: violation too.
    (fenced("open('/tmp/escape-code-reward', 'w').write('x')\n" + ADD), ADD_TESTS, "pass_fraction", 0.0,
     {"violation": 1}),
    # Two python blocks: the last one is the answer (the first is a wrong draft).
    ("Draft:\n```python\ndef add(a, b):\n    return 0\n```\nFixed:\n```python\n" + ADD + "\n```", ADD_TESTS,
     "pass_fraction", 1.0, {}),
    # A python block wins over a later block in another language.
    (fenced(ADD) + "\nRun it with:\n```bash\npython add.py\n```", ADD_TESTS, "pass_fraction", 1.0, {}),
    # An untagged block is used when there is no python one.
    (fenced(ADD, tag=""), ADD_TESTS, "pass_fraction", 1.0, {}),
    # A completion cut off inside its fence still has its code.
    ("```python\n" + ADD + "\n", ADD_TESTS, "pass_fraction", 1.0, {}),
    # tests as a JSON string (a column stored as text) are decoded.
    (fenced(ADD), json.dumps(ADD_TESTS), "pass_fraction", 1.0, {}),
    # Mixed formats in one row: a stdin/stdout case and an assert.
    (fenced("import sys\ndef add(a, b):\n    return a + b\nif __name__ == '__main__':\n"
            "    print(add(*map(int, sys.stdin.read().split())))"),
     [{"input": "2 3", "output": "5"}, "assert add(2, 2) == 4"], "pass_fraction", 1.0, {}),
]


@pytest.mark.parametrize(("completion", "tests", "mode", "expected", "events"), TABLE)
def test_reward_table(completion, tests, mode, expected, events):
    assert code_reward(["Q"], [completion], tests=[tests], mode=mode, wall_s=2) == Scored([expected], events)


def test_batch_keeps_order_and_counts_events_per_completion():
    completions = [fenced(ADD), fenced("while True:\n    pass"), "no code here, sorry", fenced(ADD)]
    two_io = [{"input": "", "output": ""}, {"input": "", "output": ""}]
    got = code_reward(["Q"] * 4, completions, tests=[ADD_TESTS, two_io, ADD_TESTS, ["assert add(1, 1) == 3"]],
                      wall_s=1, level=[1, 2, 3, 4])  # an extra column is ignored
    # The loop times out on both of its tests but counts once.
    assert got == Scored([1.0, 0.0, 0.0, 0.0], {"timeout": 1, "no_code": 1})


def test_tests_run_concurrently():
    # 4 tests that each sleep 0.6 s: one after another they would take >= 2.4 s.
    code = fenced("import time\ntime.sleep(0.6)\nprint(input())")
    tests = [{"input": str(i), "output": str(i)} for i in range(4)]
    start = time.monotonic()
    assert code_reward(["Q"], [code], tests=[tests]).rewards == [1.0]
    assert time.monotonic() - start < 2.0


def test_all_pass_stops_at_the_first_failure():
    # Test 0 fails at once; every other test sleeps past wall_s. With at most 4 sandboxes at once,
    # the tests not yet started when test 0 fails are skipped, so the call takes about one wall_s
    # (running all 9 would take >= 2 * wall_s).
    code = fenced("import time\nif input() == '0':\n    print('wrong')\nelse:\n    time.sleep(30)")
    tests = [{"input": str(i), "output": "right"} for i in range(9)]
    start = time.monotonic()
    got = code_reward(["Q"], [code], tests=[tests], mode="all_pass", wall_s=1)
    assert got.rewards == [0.0]
    assert time.monotonic() - start < 1.8


def test_extract_code():
    assert extract_code(fenced(ADD)) == ADD + "\n"
    assert extract_code("```py\nprint(1)\n```") == "print(1)\n"
    assert extract_code("x = 1\nprint(x)") == "x = 1\nprint(x)"
    assert extract_code("The answer is 42.") is None
    assert extract_code("42") is None


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode 'best' is not one of pass_fraction, all_pass"):
        code_reward(["Q"], [ADD], tests=[ADD_TESTS], mode="best")
    with pytest.raises(ValueError, match="1 prompts, 2 completions and 1 test lists"):
        code_reward(["Q"], [ADD, ADD], tests=[ADD_TESTS])
    with pytest.raises(ValueError, match="row 0: tests must be a non-empty list"):
        code_reward(["Q"], [ADD], tests=[[]])
    with pytest.raises(ValueError, match='row 0: a test is {"input": str, "output": str} or an assert string'):
        code_reward(["Q"], [ADD], tests=[[{"stdin": "1"}]])


def test_registry():
    assert "code" in reward_names()
    assert get_reward("code") is code_reward


def test_docstring_examples():
    result = doctest.testmod(code_module)
    assert result.attempted > 0 and result.failed == 0
