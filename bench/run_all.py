"""Run the six benchmarks of ``bench/perf.py``, each in its own process, one after the other.

    python bench/run_all.py [NAME ...]

Each benchmark's own figures stream as it runs; the run ends with one line per benchmark,
``<name> <value> goal <op><target> <met|missed>``, and ``bench/results.json`` (not tracked) holds all figures.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, read_result, result_line  # noqa: E402
from bench.perf import BENCHMARKS, FLOW_ENV  # noqa: E402


def main(names: list[str]) -> int:
    names = names or list(BENCHMARKS)
    env = {**os.environ, **FLOW_ENV, "PYTHONPATH": str(REPO)}
    results, lines = {}, []
    print(f"# {platform.node()} {platform.processor() or platform.machine()} {os.cpu_count()} cores, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    for name in names:
        started = time.perf_counter()
        print(f"== {name}", flush=True)
        done = subprocess.run([sys.executable, "bench/perf.py", name], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        for line in done.stdout.splitlines():
            if not line.startswith("RESULT "):
                print("  " + line, flush=True)
        _, op, target = BENCHMARKS[name]
        if done.returncode:
            lines.append(f"{name} error goal {op}{target:g} missed")
            continue
        results[name] = {**read_result(done.stdout), "seconds": time.perf_counter() - started}
        lines.append(result_line(name, results[name]["value"], op, target))
    (REPO / "bench" / "results.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))
    return 0 if all(line.endswith(" met") for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
