"""Engines' own virtualenvs: a backend whose package pins other versions than the trainer (vLLM pins its
own transformers and fastapi) runs in a Ray actor started with ``runtime_env={"py_executable": ...}``,
the Python of a venv built here from a pinned requirements file (``infra/envs/<name>-<variant>.txt``).

The venv gets the driver's torch, Ray and numpy versions (Ray needs the same Ray and Python on both ends
of a call; tensors and arrays cross between them), and is checked for them before an actor starts. It is
built once per machine under ``$ROLLFLOW_ENVS_DIR`` (default ``~/.cache/rollflow/envs``), in a folder
named by the hash of its requirements and the driver's versions, so a changed pin builds a new one and
an unchanged one is reused. ``ROLLFLOW_ENV_<NAME>`` (e.g. ``ROLLFLOW_ENV_VLLM=/opt/vllm/bin/python``)
points at a Python built elsewhere instead; it is checked the same way. On a multi-node cluster the venv
must exist at the same path on every node that hosts such an engine (a shared filesystem, or the same
build command run on each node).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS_DIR = REPO_ROOT / "infra" / "envs"

ENVS: dict[str, dict] = {
    "vllm": {
        # pip packages the engine's requirements pull in but whose wheels fail to import beside the
        # pinned torch (PyPI's torchvision, torchaudio and torchcodec are built for another torch)
        "remove": ("torchvision", "torchaudio", "torchcodec"),
        "imports": ("vllm",),
    },
}
"""Env name -> what the build removes after installing, and the modules that must import in it."""

_VERSION_PROBE = ("import json, sys, numpy, ray, torch; print(json.dumps({'python': '%d.%d.%d' % sys.version_info[:3], "
                  "'ray': ray.__version__, 'torch': torch.__version__, 'numpy': numpy.__version__}))")


class EnvError(RuntimeError):
    """An engine venv that cannot be built or does not match the driver; the message is one line."""


def driver_versions() -> dict[str, str]:
    """Python, Ray, torch and numpy versions of this process: what an engine venv must match."""
    import numpy
    import ray
    import torch

    return {"python": platform.python_version(), "ray": ray.__version__, "torch": torch.__version__,
            "numpy": numpy.__version__}


def variant() -> str:
    """``cuda`` where this machine's torch is a CUDA build, else ``cpu``: picks the requirements file."""
    import torch

    return "cuda" if torch.version.cuda else "cpu"


def requirements_file(name: str, variant_name: str | None = None) -> Path:
    return REQUIREMENTS_DIR / f"{name}-{variant_name or variant()}.txt"


def env_dir(name: str, variant_name: str | None = None) -> Path:
    """Where the venv of ``name`` lives: named by the hash of its requirements and the driver's versions."""
    requirements = requirements_file(name, variant_name)
    key = json.dumps([requirements.read_text(), driver_versions()], sort_keys=True)
    root = Path(os.environ.get("ROLLFLOW_ENVS_DIR") or Path.home() / ".cache" / "rollflow" / "envs")
    return root / f"{name}-{requirements.stem.split('-', 1)[1]}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def env_python(name: str, build: bool = True, echo: Callable[[str], None] = print) -> str:
    """The Python of env ``name``, checked against the driver's versions: ``ROLLFLOW_ENV_<NAME>`` if set,
    else the cached venv, built first (minutes, with a progress line per step) when missing and ``build``."""
    override = os.environ.get(f"ROLLFLOW_ENV_{name.upper()}")
    if override:
        python = override
    else:
        python = str(env_dir(name) / "bin" / "python")
        if not Path(python).exists():
            if not build:
                raise EnvError(f"the {name} engine's venv is not built: run `rollflow env build {name}`")
            build_env(name, echo=echo)
    check_env(name, python)
    return python


_CHECKED: dict[str, dict[str, str]] = {}


def check_env(name: str, python: str) -> dict[str, str]:
    """The versions of ``python``'s Python, Ray, torch and numpy; ``EnvError`` (one line) naming each that
    differs from the driver's. Checked once per process and Python."""
    if python not in _CHECKED:
        try:
            probe = subprocess.run([python, "-c", _VERSION_PROBE], capture_output=True, text=True, timeout=300)
        except OSError as exc:
            raise EnvError(f"the {name} engine's Python {python} does not run: {exc}") from None
        if probe.returncode:
            last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
            raise EnvError(f"the {name} engine's Python {python} cannot import numpy/ray/torch: {last}")
        _CHECKED[python] = json.loads(probe.stdout.strip().splitlines()[-1])
    theirs, ours = _CHECKED[python], driver_versions()
    differ = [f"{key} {theirs[key]} (driver {ours[key]})" for key in ours if theirs.get(key) != ours[key]]
    if differ:
        raise EnvError(f"the {name} engine's Python {python} does not match the driver: {', '.join(differ)}; "
                       f"rebuild it with `rollflow env build {name}`")
    return theirs


def build_env(name: str, variant_name: str | None = None, echo: Callable[[str], None] = print,
              force: bool = False) -> Path:
    """Build the venv of ``name`` (under a file lock: concurrent callers wait for one build) into a
    temporary folder renamed into place when complete, so a crash never leaves a half-built env in use.
    Steps: venv, the driver's torch, the requirements, removal of ``ENVS[name]["remove"]``, the driver's
    Ray and numpy, an import check. Returns the env folder."""
    spec, requirements = ENVS[name], requirements_file(name, variant_name)
    if not requirements.is_file():
        raise EnvError(f"no requirements for the {name} engine on {variant_name or variant()}: {requirements}")
    target = env_dir(name, variant_name)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "bin" / "python").exists() and not force:
            return target  # another process built it while this one waited
        versions = driver_versions()
        staging = target.with_name(target.name + ".building")
        shutil.rmtree(staging, ignore_errors=True)
        torch_pin = versions["torch"].split("+")[0]  # the local wheel of that version, CPU or CUDA
        python, pip = str(staging / "bin" / "python"), [str(staging / "bin" / "python"), "-m", "pip"]
        steps = [
            ("create the venv", [sys.executable, "-m", "venv", str(staging)]),
            (f"install torch=={torch_pin}", [*pip, "install", "-q", f"torch=={torch_pin}"]),
            (f"install {requirements.name}", [*pip, "install", "-q", "-r", str(requirements)]),
            (f"remove {', '.join(spec['remove'])}", [*pip, "uninstall", "-y", "-q", *spec["remove"]]),
            (f"pin ray=={versions['ray']} numpy=={versions['numpy']}",
             [*pip, "install", "-q", f"ray=={versions['ray']}", f"numpy=={versions['numpy']}"]),
            ("check imports", [python, "-c", "; ".join(f"import {m}" for m in spec["imports"])]),
        ]
        start = time.monotonic()
        for index, (what, command) in enumerate(steps, start=1):
            echo(f"env {name}: [{index}/{len(steps)}] {what} ({time.monotonic() - start:.0f}s)")
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()
                         and not line.startswith("WARNING: Location")]
                raise EnvError(f"building the {name} engine's venv failed at '{what}': "
                               f"{lines[-1] if lines else f'exit {done.returncode}'}")
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
        echo(f"env {name}: built {target} in {time.monotonic() - start:.0f}s")
    return target


def engine_runtime_env(name: str, runtime_env: dict | None = None, echo: Callable[[str], None] = print) -> dict:
    """``runtime_env`` for an actor of env ``name``: its Python (built on first use), and this checkout on
    ``PYTHONPATH`` so the actor imports the same ``engines`` package as the driver."""
    runtime_env = dict(runtime_env or {})
    env_vars = dict(runtime_env.get("env_vars") or {})
    env_vars["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env_vars.get("PYTHONPATH")) if p)
    return {**runtime_env, "py_executable": env_python(name, echo=echo), "env_vars": env_vars}
