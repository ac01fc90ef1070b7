"""Checks the config schema (``configs.schema``) runs at load: option names and values of registered
functions, local data files, backend names; ``CheckError`` names the keys an error is about."""

from __future__ import annotations

import difflib
import inspect
import os
import typing
from typing import Literal

from pydantic import TypeAdapter, ValidationError


class CheckError(ValueError):
    """A validator's error about particular fields: ``keys`` are their dotted paths relative to the section
    that checks them, the one to change first. The loader names the first key and, as the source, an
    override that set one of them (else the file)."""

    def __init__(self, keys: tuple[str, ...], message: str) -> None:
        super().__init__(message)
        self.keys = keys


def check_data_files(section, what: str) -> None:
    """The local data files of a ``files`` source (a ``DataConfig`` or ``DomainConfig``) must exist; remote URIs (s3://, …) are read at run time."""
    if section.source != "files":
        return
    for key in ("train_path", "heldout_path"):
        path = getattr(section, key)
        if "://" not in path and not os.path.exists(path):
            where = "" if os.path.isabs(path) else f" (relative to the working directory {os.getcwd()})"
            raise CheckError((key,), f"{what}no such file or folder {path!r}{where}; fix the path")


def backend(role: str, name: str) -> str:
    """``name`` if it is a registered ``role`` backend or a well-formed dotted path; nothing is imported."""
    from engines.backends import check_backend

    check_backend(role, name)
    return name


def check_options(allowed: set[str], name: str, options: dict, what: str) -> None:
    """Reject option names the registered function does not take (they would be silently ignored)."""
    unknown = sorted(set(options) - allowed)
    if unknown:
        close = difflib.get_close_matches(unknown[0], allowed, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"options: {', '.join(sorted(allowed)) or 'none'}"
        raise ValueError(f"{what} {name!r} has no option {unknown[0]!r}; {hint}")


def check_option_values(fn, name: str, options: dict, what: str, key: str) -> None:
    """Reject an option value that the annotation of its keyword parameter does not allow (checked strictly:
    a str is no bool, a float no int); a ``Literal`` annotation lists the allowed values."""
    hints = typing.get_type_hints(fn)
    for option, value in options.items():
        hint = hints.get(option, typing.Any)
        try:
            TypeAdapter(hint).validate_python(value, strict=True)
        except ValidationError:
            allowed = typing.get_args(hint) if typing.get_origin(hint) is Literal else ()
            want = f"one of {', '.join(map(repr, allowed))}" if allowed else f"of type {getattr(hint, '__name__', hint)}"
            raise CheckError((f"{key}.{option}",), f"{what} {name!r}: {option} must be {want}; got {value!r}") from None


def keyword_options(fn, exclude: set[str]) -> set[str]:
    params = inspect.signature(fn).parameters.values()
    return {p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is not p.empty} - exclude
