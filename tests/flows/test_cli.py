"""The CLI rejects a bad config before any work starts: exit code 2, one line naming key and file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_bad_key_fails_fast_with_one_line(tmp_path):
    out = _cli("run", "configs/tiny.yaml", f"run.dir={tmp_path}/r", "rollout.grup_size=4")
    assert out.returncode == 2
    assert out.stderr.strip() == ("config error: override 'rollout.grup_size=4': rollout.grup_size: unknown key; "
                                  "did you mean 'group_size'?")
    assert not (tmp_path / "r").exists()  # nothing started, nothing written


def test_validate_prints_the_resolved_config():
    out = _cli("validate", "configs/tiny.yaml", "run.seed=3")
    assert out.returncode == 0
    assert "seed: 3" in out.stdout and "group_size: 8" in out.stdout
