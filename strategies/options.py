"""Every strategy option, read from where it is declared: the strategy's constructor.

An option's name, type and default come from the constructor's keyword-only parameters (for a
strategy made by ``asgd_variant``, from its rule factory's), its description from the class's
numpydoc ``Parameters`` block (``fl_rescaled.settings.of_signature``). The command line
(``--fedbuff-buffer-size 5``), the Flower run config (``strategy-options = "fedbuff-buffer-size=5"``)
and the experiment runner all go through here, so an option added to a constructor reaches every
one of them, and a default lives in one place.

Options of ``AsyncStrategy`` are common to every strategy and keep their own names (``lr``,
``reply``, ``jobs-per-node``); a strategy's own options are prefixed with its registry name.
"""

from __future__ import annotations

from typing import Any

from fl_rescaled.settings import Setting, of_signature

from . import STRATEGIES
from .base import AsyncStrategy


def common_options() -> list[Setting]:
    """The options every strategy has (``AsyncStrategy``'s)."""
    return of_signature(AsyncStrategy.__init__, AsyncStrategy.__doc__, "common")


def strategy_options(name: str) -> list[Setting]:
    """The options of strategy ``name`` besides the common ones."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    cls = STRATEGIES[name]
    factory = getattr(cls, "rule_factory", None)
    if factory is None and "__init__" not in cls.__dict__:
        return []
    func, doc = (factory, factory.__doc__) if factory is not None else (cls.__init__, cls.__doc__)
    return of_signature(func, doc, name, prefix=f"{name}-", skip=[o.name for o in common_options()])


def parse_options(strategy: str, text: str) -> dict[str, Any]:
    """``"fedbuff-buffer-size=5 jobs-per-node=2"`` (a run-config string) → constructor keywords.

    Keys are the options' flags (``fedbuff-buffer-size`` or, for the strategy's own options,
    ``buffer-size``); an unknown key or a bad value raises ValueError naming it.
    """
    by_key: dict[str, Setting] = {}
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
