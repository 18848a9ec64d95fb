"""The progress bar (``fl_rescaled.metrics.ProgressBar``, on ``rich.progress``): drawn on a terminal,
silent everywhere else and when disabled."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
from pathlib import Path

from fl_rescaled.metrics import ProgressBar

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import sys
from fl_rescaled.metrics import ProgressBar
bar = ProgressBar(1000, enabled={enabled}, label="rescaled")
for t in range(0, 1001, 250):
    bar.update(t, {{"loss": 1 / (t + 1), "updates": 3 * t}}, force=True)
bar.close()
print("done", bar.enabled, file=sys.stderr)
"""


def on_a_terminal(enabled: bool) -> str:
    """What the script writes to stderr when stderr is a pseudo-terminal."""
    master, slave = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120", "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT.format(enabled=enabled)], stderr=slave,
                            stdout=subprocess.DEVNULL, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=60) == 0
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode("utf-8", "replace"))


def test_the_bar_draws_on_a_terminal():
    out = on_a_terminal(True)
    assert "rescaled" in out and "t=1,000/1,000 loss=0.0010 updates=3000" in out
    assert "t=500/1,000 loss=0.0020 updates=1500" in out
    assert out.rstrip().endswith("done True")


def test_a_disabled_bar_is_silent_on_a_terminal():
    assert on_a_terminal(False).strip() == "done False"


def test_the_bar_is_silent_when_stderr_is_not_a_terminal(capsys):
    bar = ProgressBar(10, enabled=True, label="x")
    assert not bar.enabled  # pytest's captured stderr is not a terminal
    bar.update(5, {"loss": 1.0})
    bar.close()
    assert capsys.readouterr() == ("", "")
