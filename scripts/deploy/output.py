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
        """A ``ProcessSet`` line hook: note "Receiving: train", "Sending: train" and "Sent
        successfully" (a reply, its objects included, is in the SuperLink) lines."""
        events = self.events.setdefault(name, [])
        if "Receiving: train" in line:
            events.append((now, "recv"))
        elif "Sending: train" in line:
            events.append((now, "send"))
        elif "Sent successfully" in line:
            events.append((now, "sent"))

    def reply_times(self, name: str | None = None) -> list[float]:
        """Wall times of the train replies sent so far, in order: by every process, or by ``name``
        (a node's every life: a revived node logs under the same name)."""
        chosen = list(self.events.values()) if name is None else [self.events.get(name, [])]
        return sorted(t for events in chosen for t, kind in list(events) if kind == "send")

    def sending_since(self, name: str, t: float) -> float | None:
        """If ``name`` was in the middle of sending a train reply at wall time ``t`` (its last
        "Sending: train" before ``t`` had no "Sent successfully" yet), when it began; else None."""
        last = [(s, kind) for s, kind in list(self.events.get(name, [])) if s <= t and kind in ("send", "sent")]
        return last[-1][0] if last and last[-1][1] == "send" else None

    def node_stats(self) -> dict[str, Any]:
        """Per node, from its timestamped log: train messages, median time from receiving a
        message to sending its reply (ClientApp process start + compute + emulated τ), and
        median interval between two replies (the node's delivery period; a killed node's includes
        its time away). A node handles one message at a time, so a reply answers the message
        received last; a message that a kill left without a reply is skipped."""
        out: dict[str, Any] = {}
        for name, events in sorted(self.events.items()):
            if not name.startswith("node"):
                continue
            inside, received = [], None
            for t, kind in list(events):
                if kind == "recv":
                    received = t
                elif kind == "send" and received is not None:
                    inside.append(t - received)
                    received = None
            send = [t for t, kind in events if kind == "send"]
            gaps = [b - a for a, b in zip(send, send[1:])]
            out[name] = {
                "train_messages": len(send),
                "median_in_node_s": round(median(inside), 3) if inside else None,
                "median_reply_interval_s": round(median(gaps), 3) if gaps else None,
            }
        return out
