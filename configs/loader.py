"""Load a YAML preset plus ``a.b=value`` overrides into a validated ``Config``.

Any problem ends in one ``ConfigError`` line that names the key, where it came from (the file or the
override) and what is allowed, e.g.::

    configs/tiny.yaml: rollout.group_sise: unknown key; did you mean 'group_size'?
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from configs.schema import Config, CheckError

PRESETS_DIR = Path(__file__).parent

# The config schema of each pipeline kind, by the top-level ``kind`` key (default rlvr).
KINDS: dict[str, type[BaseModel]] = {kind: Config for kind in typing.get_args(Config.model_fields["kind"].annotation)}


class ConfigError(ValueError):
    """A configuration that cannot run; the message is one line saying what to change."""


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"optim.lr=1e-4"`` → ``(["optim", "lr"], 0.0001)``; the value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r}: expected key=value, e.g. run.seed=1")
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else None


def _set(tree: dict, path: list[str], value: Any) -> None:
    for part in path[:-1]:
        child = tree.get(part)
        if not isinstance(child, dict):
            child = tree[part] = {}
        tree = child
    tree[path[-1]] = value


def _section_at(loc: tuple) -> type[BaseModel] | None:
    """The pydantic model class that holds the field at ``loc[:-1]``."""
    model: Any = Config
    for part in loc[:-1]:
        field = _field(model, part) if isinstance(part, str) else None
        if field is None:
            return None
        candidates = [field.annotation, *typing.get_args(field.annotation)]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return None
    return model


def _field(model: type[BaseModel], key: str):
    """The field of ``model`` spelled ``key`` in YAML: its alias (``async``) or its name."""
    return next((f for name, f in model.model_fields.items() if key in (name, f.alias)), None)


def _describe(error: dict) -> str:
    loc = tuple(error["loc"])
    key = ".".join(str(p) for p in loc) or "<root>"
    if error["type"] == "extra_forbidden":
        section = _section_at(loc)
        valid = [field.alias or name for name, field in section.model_fields.items()] if section else []
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(valid)}"
        return f"{key}: unknown key; {hint}"
    message = error["msg"].removeprefix("Value error, ")
    got = error.get("input")
    shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {got!r})"
    return f"{key}: {message}{shown}"


def resolve_preset(path: str | Path) -> Path:
    """A path as given, or a preset name relative to the installed ``configs/`` folder."""
    candidate = Path(path)
    if candidate.exists():
        return candidate
    for alt in (PRESETS_DIR / candidate, PRESETS_DIR / f"{candidate}.yaml", PRESETS_DIR / candidate.name):
        if alt.exists():
            return alt
    raise ConfigError(f"{path}: no such config file (presets live in {PRESETS_DIR})")


def _merge(base: dict, child: dict) -> dict:
    """``child`` over ``base``; nested mappings merge key by key, anything else is replaced."""
    out = dict(base)
    for key, value in child.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def read_tree(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict:
    """The YAML mapping of ``path``; a top-level ``base: other.yaml`` (relative to this file) is read
    first and this file's keys are merged over it."""
    file = resolve_preset(path)
    source = str(path)
    try:
        tree = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}".replace("\n", " ")) from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    base = tree.pop("base", None)
    if base is None:
        return tree
    base_path = file.parent / base if (file.parent / base).exists() else base
    if file.resolve() in _seen:
        raise ConfigError(f"{source}: base: {base}: configs include each other in a loop")
    return _merge(read_tree(base_path, (*_seen, file.resolve())), tree)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Read ``path`` (YAML, with its ``base:`` chain) if given, apply ``overrides``, validate; raise
    ``ConfigError`` on any problem."""
    source = str(path) if path is not None else "<defaults>"
    tree: dict = read_tree(path) if path is not None else {}
    overridden: dict[tuple, str] = {}
    for text in overrides:
        keys, value = parse_override(text)
        _set(tree, keys, value)
        overridden[tuple(keys)] = text
    kind = tree.get("kind", "rlvr")
    schema = KINDS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        origin = overridden.get(("kind",)) and f"override {overridden[('kind',)]!r}"
        raise ConfigError(f"{origin or source}: kind: unknown pipeline kind {kind!r}; known: {', '.join(KINDS)}")
    try:
        return schema.model_validate(tree)
    except ValidationError as exc:
        error = exc.errors()[0]
        locs = _error_keys(error)
        shared = lambda keys, loc: min(len(keys), len(loc)) and keys[: len(loc)] == loc[: len(keys)]  # noqa: E731
        origin = next((f"override {text!r}" for loc in locs for keys, text in overridden.items() if shared(keys, loc)),
                      source)
        raise ConfigError(f"{origin}: {_describe({**error, 'loc': locs[0]})}") from None


def _error_keys(error: dict) -> list[tuple]:
    """The full paths an error is about: its location, or the keys a ``CheckError`` names under it."""
    loc = tuple(error["loc"])
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, CheckError):
        return [loc + tuple(key.split(".")) for key in cause.keys]
    return [loc]


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def flat_params(config: Config) -> dict[str, str]:
    """``{"rollout.group_size": "8", …}`` for MLflow params."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = str(value)

    walk("", config.model_dump(mode="json"))
    return out
