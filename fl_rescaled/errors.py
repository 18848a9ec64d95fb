"""The errors a run reports: a reply that must not touch the model, and a run that cannot go on."""

from __future__ import annotations

import re
from typing import Any

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class RejectedReply(Exception):
    """A reply that must not touch the model; ``reason`` is a short tag, ``detail`` says what was expected."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class RunFailed(RuntimeError):
    """The run cannot make progress (every reply so far was rejected, or too many in a row).

    ``books`` holds the run's books at that moment (the same keys as ``AsyncResult.books``);
    ``result``, for a run whose model diverged, the ``AsyncResult`` of the best evaluation point so
    far (its model and the metrics up to the failure), else None.
    """

    def __init__(self, message: str, books: dict | None = None, result: Any = None) -> None:
        super().__init__(message)
        self.books = dict(books or {})
        self.result = result


def one_line(text: str, limit: int = 2000) -> str:
    """``text`` as one printable line: line breaks and other control characters (from a value the
    user typed, say) shown escaped, as in a Python string literal."""
    out = "".join(ch if ch.isprintable() or ch == " " else ch.encode("unicode_escape").decode("ascii")
                  for ch in str(text).strip())
    return out if len(out) <= limit else out[: limit - 1] + "…"


#: Exceptions that only wrap the ClientApp's own (Flower's and Ray's), skipped when the reason has it.
_WRAPPERS = ("ClientAppException", "RayTaskError", "RayActorError")
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)\w*)(?:\(.*\))?(?::\s*(.*))?$")


def client_error_text(reason: str, limit: int = 400) -> str:
    """The useful part of an error reply's reason: the ClientApp's own exception, one line.

    Flower's runtimes wrap it differently: ``<class 'RuntimeError'>:<'boom'>`` in a deployment; on
    the Simulation Engine a Ray traceback with colour codes, in which the ClientApp's exception
    (``KeyError: 'lr'``) comes first and Flower's ``ClientAppException:`` wrapper last, its message
    on the next line. This keeps the ClientApp's own ``Name: message`` line, without colour codes.
    """
    text = _ANSI.sub("", str(reason)).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    own = None
    for i, ln in enumerate(lines):
        m = _EXC_LINE.match(ln)
        if m is None:
            continue
        name, message = m.group(1), (m.group(2) or "").strip()
        if name.rsplit(".", 1)[-1] in _WRAPPERS:
            if own is None and not message and i + 1 < len(lines):  # (only the wrapper: its next line)
                own = lines[i + 1]
            continue
        own = f"{name.rsplit('.', 1)[-1]}: {message}" if message else name.rsplit(".", 1)[-1]
    if own is not None:
        text = own
    else:
        m = re.match(r"^<class '([^']+)'>:<'(.*)'>$", text, re.S)
        if m:
            text = f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2)}"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def failure_text(reason: str, detail: str, limit: int = 400) -> str:
    """A failed job's detail on one line of at most ``limit`` characters: the ClientApp's own
    exception for Flower's error replies (``error-code-N``), else the detail as one line."""
    return client_error_text(detail, limit) if reason.startswith("error-code") else one_line(detail, limit)
