"""Checkpoint folders on a local path or object storage (fsspec), complete only once their manifest exists.

Layout under a run directory::

    checkpoints/step_000010/policy/…        engine state (model, optimizer, scheduler, RNG)
    checkpoints/step_000010/state.json      step, data position, MLflow run id, evaluation history
    checkpoints/step_000010/MANIFEST.json   written last; lists the files above

A crash at any point leaves either a complete checkpoint or a folder without a manifest, which
``latest_checkpoint`` ignores.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

MANIFEST = "MANIFEST.json"


def filesystem(uri: str):
    """``(fs, path)`` for ``uri``. Object-store listings are re-read each time: other processes (the engine
    actors) write checkpoints too, and a cached listing would miss them."""
    fs, path = fsspec.core.url_to_fs(uri)
    if not isinstance(fs, LocalFileSystem):
        fs.invalidate_cache()
    return fs, path


def is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


def write_bytes(uri: str, data: bytes) -> None:
    """Write a file atomically: rename on a local disk, a single PUT on object storage.

    Never creates a bucket: a bucket that is gone (deleted, wrong name, no access) is an error here,
    not a fresh empty bucket that would hide the loss of every earlier checkpoint."""
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


def write_json(uri: str, payload: dict[str, Any]) -> None:
    write_bytes(uri, json.dumps(payload, indent=1, sort_keys=True).encode())


def read_bytes(uri: str) -> bytes | None:
    """The file's bytes, or None when there is no such file."""
    fs, path = filesystem(uri)
    return fs.cat_file(path) if fs.exists(path) else None


def read_json(uri: str) -> dict[str, Any] | None:
    data = read_bytes(uri)
    return None if data is None else json.loads(data)


def put_folder(local_dir: str, uri: str) -> list[str]:
    """Copy the files of ``local_dir`` to the folder ``uri`` (replacing it); returns their relative paths.

    On a local disk the folder is swapped in by rename; on object storage each file is one PUT, and an
    upload error propagates (the caller's manifest is then never written)."""
    files = sorted(str(p.relative_to(local_dir)) for p in Path(local_dir).rglob("*") if p.is_file())
    fs, path = filesystem(uri)
    if isinstance(fs, LocalFileSystem):
        tmp = f"{path}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(local_dir, tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        return files
    if fs.exists(path):
        fs.rm(path, recursive=True)
    for name in files:
        fs.put_file(os.path.join(local_dir, name), f"{path}/{name}")
    return files


def local_copy(uri: str, cache_dir: str | None = None) -> str:
    """A local folder with the files of ``uri``: the path itself when local (or a hub id), else a copy
    downloaded once into ``$ROLLFLOW_CACHE`` (default ``~/.cache/rollflow``), keyed by the URI."""
    if not is_remote(uri):
        return uri.removeprefix("file://")
    root = Path(cache_dir or os.environ.get("ROLLFLOW_CACHE") or Path.home() / ".cache" / "rollflow") / "remote"
    out = root / hashlib.sha256(uri.encode()).hexdigest()[:16]
    if (out / ".complete").exists():
        return str(out)
    fs, path = filesystem(uri)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root))
    for remote in fs.find(path):
        target = tmp / os.path.relpath(remote, path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(remote, str(target))
    (tmp / ".complete").write_text(uri)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return str(out)


def step_dir(run_dir: str, step: int) -> str:
    return join(run_dir, "checkpoints", f"step_{step:06d}")


def write_manifest(checkpoint_uri: str, step: int, files: list[str], key: str | None = None) -> None:
    """Mark ``checkpoint_uri`` complete. Every listed file must already exist. ``key``: what the folder was
    made from (a stage's key, ``flows/stages.py``), stored in the manifest."""
    fs, path = filesystem(checkpoint_uri)
    missing = [f for f in files if not fs.exists(f"{path}/{f}")]
    if missing:
        raise FileNotFoundError(f"checkpoint {checkpoint_uri} lacks {missing}; manifest not written")
    extra = {"key": key} if key is not None else {}
    write_json(join(checkpoint_uri, MANIFEST), {"step": step, "files": sorted(files), "written_at": time.time(), **extra})


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
