"""Name → object registries shared by algorithms, rewards and engine backends.

A duplicate name is an error at import time; an unknown name lists the valid ones.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any, Callable, Generic, Iterable, TypeVar

T = TypeVar("T")

_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
DOTTED_PATH = re.compile(rf"{_IDENTIFIER}(\.{_IDENTIFIER})*:{_IDENTIFIER}(\.{_IDENTIFIER})*")
"""An object named by import path, ``package.module:attribute`` (a backend class, a reward function)."""


def import_path(path: str) -> Any:
    """The object at ``path`` (``DOTTED_PATH``), its module imported now."""
    module, _, attribute = path.partition(":")
    obj = importlib.import_module(module)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj


class Registry(Generic[T]):
    """A named collection of callables, filled with the ``register`` decorator."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def keyword_options(self, name: str) -> set[str]:
        """The keyword-only parameters with a default of the entry ``name``: the options a caller may set."""
        params = inspect.signature(self.get(name)).parameters.values()
        return {p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is not p.empty}

    def check_options(self, name: str, options: Iterable[str]) -> None:
        """Raise naming the entry and the options it takes when ``options`` holds a name it does not take."""
        allowed = self.keyword_options(name)
        unknown = sorted(set(options) - allowed)
        if unknown:
            takes = ", ".join(sorted(allowed)) or "no options"
            raise ValueError(f"{self.kind} {name!r} does not take {', '.join(unknown)}; it takes: {takes}")

    def __contains__(self, name: str) -> bool:
        return name in self._entries
