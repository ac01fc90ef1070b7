"""Checkpoint folders on a local path or object storage (fsspec), complete only once their manifest exists.

Layout under a run directory::

    checkpoints/step_000010/policy/…        engine state (model, optimizer, scheduler, RNG)
    checkpoints/step_000010/state.json      step, data position, MLflow run id, evaluation history
    checkpoints/step_000010/MANIFEST.json   written last; lists the files above

A crash at any point leaves either a complete checkpoint or a folder without a manifest, which
``latest_checkpoint`` ignores.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

MANIFEST = "MANIFEST.json"


def filesystem(uri: str):
    fs, path = fsspec.core.url_to_fs(uri)
    return fs, path


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


def write_json(uri: str, payload: dict[str, Any]) -> None:
    """Write JSON atomically: rename on a local disk, a single PUT on object storage."""
    data = json.dumps(payload, indent=1, sort_keys=True).encode()
    fs, path = filesystem(uri)
    if isinstance(fs, LocalFileSystem):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    else:
        fs.pipe_file(path, data)


def read_json(uri: str) -> dict[str, Any] | None:
    fs, path = filesystem(uri)
    if not fs.exists(path):
        return None
    return json.loads(fs.cat_file(path))


def step_dir(run_dir: str, step: int) -> str:
    return join(run_dir, "checkpoints", f"step_{step:06d}")


def write_manifest(checkpoint_uri: str, step: int, files: list[str]) -> None:
    """Mark ``checkpoint_uri`` complete. Every listed file must already exist."""
    fs, path = filesystem(checkpoint_uri)
    missing = [f for f in files if not fs.exists(f"{path}/{f}")]
    if missing:
        raise FileNotFoundError(f"checkpoint {checkpoint_uri} lacks {missing}; manifest not written")
    write_json(join(checkpoint_uri, MANIFEST), {"step": step, "files": sorted(files), "written_at": time.time()})


def complete_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """``[(step, uri)]`` of checkpoints with a manifest, oldest first."""
    fs, path = filesystem(join(run_dir, "checkpoints"))
    if not fs.exists(path):
        return []
    found = []
    for entry in fs.ls(path, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("step_") and fs.exists(f"{entry}/{MANIFEST}"):
            found.append((int(name.removeprefix("step_")), join(run_dir, "checkpoints", name)))
    return sorted(found)


def latest_checkpoint(run_dir: str) -> tuple[int, str] | None:
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def prune(run_dir: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints, and incomplete ones older than them."""
    done = complete_checkpoints(run_dir)
    removed = [uri for _, uri in done[:-keep]] if len(done) > keep else []
    fs, _ = filesystem(run_dir)
    for uri in removed:
        fs.rm(filesystem(uri)[1], recursive=True)
    return removed
