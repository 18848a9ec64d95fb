"""Settings: one description of every option, wherever it is declared, and one parser for their text.

A ``Setting`` is an option as the command line (``--eval-every 100``) and the Flower run config
(``eval-every = 100``) see it: its name, flag, kind, default, description and allowed values. Every
setting is declared once, where it belongs, and read from there:

- the fields of a dataclass (``RunSpec``: the run; ``ManagerSettings``: the client manager), each
  declared with ``setting(default, help, ...)`` (``of_dataclass``);
- the keyword-only parameters of a strategy's constructor (or of its stepsize rule's factory), with
  their descriptions from its numpydoc ``Parameters`` block (``of_signature``).

``Setting.parse`` turns a string into a checked value, and its errors are one line naming the flag.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import re
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

KINDS = ("float", "int", "str", "bool", "floats")
_EXPECTED = {"floats": "comma-separated finite numbers", "bool": "true or false", "int": "an integer",
             "float": "a finite number", "str": "a string"}


@dataclass(frozen=True)
class Setting:
    """One option: see the module docstring. ``owner``: ``run``, ``manager``, ``common`` (every
    strategy) or a strategy's name. ``low``/``high``: inclusive bounds of a number (of every item
    of a list); ``positive``: above 0; ``choices``: the allowed strings."""

    name: str  # the Python name: "eval_every", "buffer_size"
    key: str  # the flag without "--", and the run-config key: "eval-every", "fedbuff-buffer-size"
    kind: str  # one of KINDS
    default: Any
    optional: bool  # None is a valid value ("none"; the default means "derived", see the description)
    help: str
    owner: str
    low: float | None = None
    high: float | None = None
    positive: bool = False
    choices: tuple[str, ...] = ()

    def parse(self, text: Any) -> Any:
        """The checked value of a command-line or run-config string; ValueError with a one-line reason.

        An empty string is an error (a flag given with no value is a mistake, not "the default");
        ``none`` is None for an optional setting. Lists refuse empty items (``1,,2``).
        """
        text = str(text).strip()
        if self.optional and text.lower() == "none":
            return None
        if text == "":
            raise ValueError(f"--{self.key}: expected {_EXPECTED[self.kind]}, got an empty value")
        try:
            value = _convert(self.kind, text)
        except ValueError:
            raise ValueError(f"--{self.key}: expected {_EXPECTED[self.kind]}, got {text!r}") from None
        return self.check(value)

    def check(self, value: Any) -> Any:
        """``value`` if it is allowed, else ValueError naming the flag."""
        if value is None:
            if not self.optional:
                raise ValueError(f"--{self.key}: a value is required")
            return value
        if self.choices and value not in self.choices:
            raise ValueError(f"--{self.key}: choose one of {', '.join(c or repr(c) for c in self.choices)}, "
                             f"got {value!r}")
        for v in (value if isinstance(value, list) else [value]):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if not math.isfinite(v):
                raise ValueError(f"--{self.key}: must be finite, got {v!r}")
            if self.positive and not v > 0:
                raise ValueError(f"--{self.key} must be positive, got {v!r}")
            if (self.low is not None and v < self.low) or (self.high is not None and v > self.high):
                raise ValueError(f"--{self.key} must be in {_bound(self.low)}..{_bound(self.high)}, got {v!r}")
        return value


def _bound(b: float | None) -> str:
    if b is None:
        return ""
    return f"{int(b):,}" if float(b).is_integer() else f"{b:g}"


def _convert(kind: str, text: str) -> Any:
    if kind == "float":
        return _finite(float(text))
    if kind == "int":
        return int(text)
    if kind == "bool":
        said = yes_or_no(text)
        if said is None:
            raise ValueError(text)
        return said
    if kind == "floats":
        items = text.split(",")
        if any(not item.strip() for item in items):
            raise ValueError(text)
        return [_finite(float(item)) for item in items]
    return text


def yes_or_no(text: str) -> bool | None:
    """``1``/``true``/``yes``/``on`` → True, ``0``/``false``/``no``/``off`` → False (any case),
    anything else None: the words a bool setting or an on/off variable takes."""
    low = text.lower()
    return True if low in ("1", "true", "yes", "on") else False if low in ("0", "false", "no", "off") else None


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(value)
    return value


def setting(default: Any, help: str, *, low: float | None = None, high: float | None = None,  # noqa: A002
            positive: bool = False, choices: Sequence[str] = (), cli: bool = True) -> Any:
    """A dataclass field declared as a setting (``cli=False``: not a flag or run-config key)."""
    meta = {"help": help, "low": low, "high": high, "positive": positive, "choices": tuple(choices), "cli": cli}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def kind_of(hint: Any) -> tuple[str, bool]:
    """(kind, optional) of a type hint: ``float``, ``int | None``, ``list[float] | None``, ..."""
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        optional = type(None) in args
        rest = [a for a in args if a is not type(None)]
        hint = rest[0] if len(rest) == 1 else str
    origin = typing.get_origin(hint)
    if origin is not None and isinstance(origin, type) and issubclass(origin, Sequence) and origin is not str:
        return "floats", optional
    for kind, tp in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if hint is tp:
            return kind, optional
    return "str", optional


def of_dataclass(cls: type, owner: str) -> list[Setting]:
    """The settings of a dataclass's fields declared with ``setting`` (and ``cli`` true)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "help" not in meta or not meta.get("cli", True):
            continue
        kind, optional = kind_of(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        out.append(Setting(f.name, f.name.replace("_", "-"), kind, default, optional or default is None, meta["help"],
                           owner, meta["low"], meta["high"], meta["positive"], meta["choices"]))
    return out


def of_signature(func: Callable[..., Any], doc: str | None, owner: str, prefix: str = "",
                 skip: Sequence[str] = ()) -> list[Setting]:
    """The settings of a callable's keyword parameters (``self`` and ``skip`` left out), described
    by the numpydoc ``Parameters`` block of ``doc``; keys are ``prefix`` + the name in kebab case."""
    hints = typing.get_type_hints(func)
    docs = numpydoc_parameters(doc)
    out = []
    for p in inspect.signature(func).parameters.values():
        if p.kind not in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) or p.name == "self" or p.name in skip:
            continue
        if _callable(hints.get(p.name)):  # (a function: an option of Python callers, not of text)
            continue
        kind, optional = kind_of(hints.get(p.name, str))
        key = prefix + p.name.replace("_", "-").lower()
        out.append(Setting(p.name, key, kind, p.default, optional or p.default is None, docs.get(p.name, ""), owner))
    return out


def _callable(hint: Any) -> bool:
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return any(typing.get_origin(a) is Callable or a is Callable for a in args)


def numpydoc_parameters(doc: str | None) -> dict[str, str]:
    """Parameter descriptions from a numpydoc ``Parameters`` block (``name : type`` lines)."""
    out: dict[str, str] = {}
    if not doc:
        return out
    lines = inspect.cleandoc(doc).splitlines()
    try:
        start = lines.index("Parameters") + 2
    except ValueError:
        return out
    name = None
    for line in lines[start:]:
        if line and not line.startswith(" "):
            if re.match(r"^-+$", line) or line in ("Returns", "Raises", "Notes"):
                break
            m = re.match(r"^(\w+)\s*:", line)
            name = m.group(1) if m and "," not in line.split(":")[0] else None
            if name:
                out[name] = ""
        elif name and line.strip():
            out[name] = (out[name] + " " + line.strip()).strip()
    return out


def cpu_info(path: str = "/proc/cpuinfo") -> dict[str, str]:
    """The fields of this machine's first CPU in ``/proc/cpuinfo`` (``vendor_id``, ``cpu family``,
    ``model name``, ...); empty where the file cannot be read (not on Linux)."""
    out: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if not key:
                    if out:  # (the first processor's block ended)
                        break
                    continue
                out.setdefault(key, value.strip())
    except OSError:
        return {}
    return out


def available_cores() -> int:
    """The cores this process may run on (the default of ``--workers``, and what decides the worker
    processes of ``fl_rescaled.tasks.kernel_process``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # (not on Linux)
        return max(1, os.cpu_count() or 1)
