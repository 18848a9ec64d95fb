"""Every strategy option, read from where it is declared: the strategy's constructor.

An option's name, type and default come from the constructor's keyword-only parameters (for a
strategy made by ``asgd_variant``, from its rule factory's), its description from the class's
numpydoc ``Parameters`` block. The command line (``--fedbuff-buffer-size 5``), the Flower run config
(``strategy-options = "fedbuff-buffer-size=5"``) and the experiment runner all go through here, so
an option added to a constructor reaches every one of them, and a default lives in one place.

Options of ``AsyncStrategy`` are common to every strategy and keep their own names (``lr``,
``reply``, ``jobs-per-node``); a strategy's own options are prefixed with its registry name.
"""

from __future__ import annotations

import inspect
import math
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from . import STRATEGIES
from .base import AsyncStrategy

KINDS = ("float", "int", "str", "bool", "floats")


@dataclass(frozen=True)
class Option:
    name: str  # the constructor's keyword: "buffer_size"
    key: str  # the command-line flag without "--", and the run-config key: "fedbuff-buffer-size"
    kind: str  # one of KINDS
    default: Any
    optional: bool  # None is a valid value (the default means "derived", see the description)
    help: str
    strategy: str | None  # None: common to every strategy

    def parse(self, text: str) -> Any:
        """The value of a command-line or run-config string; raises ValueError with a one-line reason."""
        return parse_value(self.kind, self.optional, self.key, text)


def parse_value(kind: str, optional: bool, key: str, text: str) -> Any:
    """A command-line or run-config string as a value of ``kind`` (one of ``KINDS``); ""/"none" is
    None when ``optional``. Raises ValueError naming the flag ``--key`` and what it expected."""
    text = str(text).strip()
    if optional and text.lower() in ("", "none"):
        return None
    try:
        if kind == "float":
            return _finite(float(text))
        if kind == "int":
            return int(text)
        if kind == "bool":
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if kind == "floats":
            values = [_finite(float(v)) for v in text.split(",") if v.strip()]
            if not values:
                raise ValueError(text)
            return values
        return text
    except ValueError:
        expected = {"floats": "comma-separated finite numbers", "bool": "true or false", "int": "an integer",
                    "float": "a finite number"}.get(kind, f"a {kind}")
        raise ValueError(f"--{key}: expected {expected}, got {text!r}") from None


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(value)
    return value


def _kind(hint: Any) -> tuple[str, bool]:
    """(kind, optional) of a type hint such as ``float``, ``int | None``, ``Sequence[float] | None``."""
    args = typing.get_args(hint)
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        optional = type(None) in args
        rest = [a for a in args if a is not type(None)]
        hint = rest[0] if len(rest) == 1 else str
    origin = typing.get_origin(hint)
    if origin is not None and issubclass(origin, Sequence) and origin is not str:
        return "floats", optional
    for kind, tp in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if hint is tp:
            return kind, optional
    return "str", optional


def _docs(doc: str | None) -> dict[str, str]:
    """Parameter descriptions from a numpydoc ``Parameters`` block."""
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


def _own_parameters(cls: type) -> tuple[list[inspect.Parameter], dict[str, Any], dict[str, str]]:
    factory = getattr(cls, "rule_factory", None)
    func = factory if factory is not None else cls.__init__
    params = [p for p in inspect.signature(func).parameters.values()
              if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"]
    return params, typing.get_type_hints(func), _docs(factory.__doc__ if factory is not None else cls.__doc__)


def _options(cls: type, strategy: str | None) -> list[Option]:
    params, hints, docs = _own_parameters(cls)
    out = []
    for p in params:
        kind, optional = _kind(hints.get(p.name, str))
        optional = optional or p.default is None
        key = p.name.replace("_", "-").lower()
        out.append(Option(p.name, key if strategy is None else f"{strategy}-{key}", kind, p.default, optional,
                          docs.get(p.name, ""), strategy))
    return out


def common_options() -> list[Option]:
    """The options every strategy has (``AsyncStrategy``'s)."""
    return _options(AsyncStrategy, None)


def strategy_options(name: str) -> list[Option]:
    """The options of strategy ``name`` besides the common ones."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    cls = STRATEGIES[name]
    common = {o.name for o in common_options()}
    if "__init__" not in cls.__dict__ and getattr(cls, "rule_factory", None) is None:
        return []
    return [o for o in _options(cls, name) if o.name not in common]


def all_options() -> list[Option]:
    return common_options() + [o for name in STRATEGIES for o in strategy_options(name)]


def option_default(name: str, strategy: str | None = None) -> Any:
    """The declared default of option ``name`` (common, or of ``strategy``)."""
    for o in (common_options() if strategy is None else strategy_options(strategy)):
        if o.name == name:
            return o.default
    raise KeyError(name)


def parse_options(strategy: str, text: str) -> dict[str, Any]:
    """``"fedbuff-buffer-size=5 jobs-per-node=2"`` (a run-config string) → constructor keywords.

    Keys are the options' flags (``fedbuff-buffer-size`` or, for the strategy's own options,
    ``buffer-size``); an unknown key or a bad value raises ValueError naming it.
    """
    by_key: dict[str, Option] = {}
    for o in common_options() + strategy_options(strategy):
        by_key[o.key] = o
        by_key[o.key.removeprefix(f"{strategy}-")] = o
    out: dict[str, Any] = {}
    for item in str(text).replace(";", " ").split():
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"strategy-options: expected key=value, got {item!r}")
        if key not in by_key:
            raise ValueError(f"strategy-options: {strategy} has no option {key!r}; it has "
                             f"{', '.join(sorted(o.key for o in common_options() + strategy_options(strategy)))}")
        opt = by_key[key]
        out[opt.name] = opt.parse(value.strip("'\""))
    return out


def build(strategy: str, options: dict[str, Any] | None = None) -> AsyncStrategy:
    """``STRATEGIES[strategy](**options)``, with a clear error for an option it does not have."""
    options = dict(options or {})
    known = {o.name for o in common_options() + strategy_options(strategy)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"{strategy} has no option {', '.join(unknown)}")
    return STRATEGIES[strategy](**options)
