"""What the script reads from the processes' output, and how it reports."""

from __future__ import annotations

import json
import sys
import time
from statistics import median
from typing import Any

from fl_rescaled.server_app import RESULT_PREFIX  # the ServerApp's result line


def log(msg: str) -> None:
    print(f"[deploy {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class ResultScanner:
    """Finds ``fl-rescaled result: {json}`` in a log stream (the JSON may span several lines)."""

    def __init__(self) -> None:
        self.result: dict[str, Any] | None = None
        self._buf: str | None = None
        self._lines = 0

    def feed(self, line: str) -> None:
        if self._buf is None:
            k = line.find(RESULT_PREFIX)
            if k < 0:
                return
            self._buf, self._lines = line[k + len(RESULT_PREFIX):].strip(), 0
        else:
            self._buf += line.rstrip("\n")
            self._lines += 1
        start = self._buf.find("{")
        if start < 0:
            return
        try:
            obj, _ = json.JSONDecoder().raw_decode(self._buf[start:])
        except json.JSONDecodeError:
            if self._lines > 200:
                self._buf = None
            return
        self.result, self._buf = obj, None


class NodeEvents:
    """Per process, the wall times at which it received a train message and sent its reply."""

    def __init__(self) -> None:
        self.events: dict[str, list[tuple[float, str]]] = {}

    def feed(self, name: str, now: float, line: str) -> None:
        """A ``ProcessSet`` line hook: note "Receiving: train" / "Sending: train" lines."""
        events = self.events.setdefault(name, [])
        if "Receiving: train" in line:
            events.append((now, "recv"))
        elif "Sending: train" in line:
            events.append((now, "send"))

    def reply_times(self) -> list[float]:
        """Wall times of the train replies sent so far, in order."""
        return sorted(t for events in list(self.events.values()) for t, kind in list(events) if kind == "send")

    def node_stats(self) -> dict[str, Any]:
        """Per node, from its timestamped log: train messages, median time from receiving a
        message to sending its reply (ClientApp process start + compute + emulated τ), and
        median interval between two replies (the node's delivery period)."""
        out: dict[str, Any] = {}
        for name, events in sorted(self.events.items()):
            if not name.startswith("node"):
                continue
            recv = [t for t, kind in events if kind == "recv"]
            send = [t for t, kind in events if kind == "send"]
            inside = [s - r for r, s in zip(recv, send) if s >= r]
            gaps = [b - a for a, b in zip(send, send[1:])]
            out[name] = {
                "train_messages": len(send),
                "median_in_node_s": round(median(inside), 3) if inside else None,
                "median_reply_interval_s": round(median(gaps), 3) if gaps else None,
            }
        return out
