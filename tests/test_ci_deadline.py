"""``ROLLFLOW_TEST_DEADLINE``: tests that would start after it are skipped with the reason, not run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pytest(deadline: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "ROLLFLOW_TEST_DEADLINE": str(deadline)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "tests/test_import_direction.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_tests_past_the_deadline_are_skipped_and_named():
    done = _pytest(time.time() - 1)
    assert done.returncode == 0, done.stdout[-2000:]
    assert "3 skipped" in done.stdout and "CI's time budget for this test session is spent" in done.stdout


def test_tests_before_the_deadline_run():
    done = _pytest(time.time() + 3600)
    assert done.returncode == 0 and "3 passed" in done.stdout, done.stdout[-2000:]
