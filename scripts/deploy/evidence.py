"""What a secure deployment shows about SuperNodes whose keys were not registered.

Three independent witnesses, all read after the fact:

- the intruder's own log and exit status: ``flower-supernode`` prints ``[code: 2004] Failed to
  activate SuperNode.`` and exits when the SuperLink does not know its public key;
- the SuperLink's log: ``[/v1/fleet/activate-node][ApiError:2004] Attempted to register SuperNode
  with public key: b'-----BEGIN PUBLIC KEY-----\\n...'`` carries the refused key, which is matched
  against the intruder's own public key;
- the SuperLink's node list and the node ids its Fleet API accepted replies from
  (``[Fleet.PushMessages] Push replies from node_id=...``): only registered ids may appear.
"""

from __future__ import annotations

import re
from typing import Any

from .credentials import NodeKey
from .processes import Proc

REFUSED = "[code: 2004]"  # ApiErrorCode.FLEET_NODE_ACTIVATION_FAILED, as the SuperNode prints it
_PEM_BODY = re.compile(r"BEGIN PUBLIC KEY-----(.*?)-----END PUBLIC KEY")
_REPLY_FROM = re.compile(r"Push replies from node_id=(\d+)")


def refused_keys(superlink_log: str) -> set[str]:
    """Base64 bodies of the public keys in the SuperLink's ApiError:2004 lines."""
    keys = set()
    for line in superlink_log.splitlines():
        if "ApiError:2004" in line:
            for body in _PEM_BODY.findall(line):
                keys.add(body.replace("\\n", "").strip())
    return keys


def reply_node_ids(superlink_log: str) -> list[int]:
    """Node ids the SuperLink accepted replies from, in first-seen order."""
    seen: dict[int, None] = {}
    for match in _REPLY_FROM.finditer(superlink_log):
        seen.setdefault(int(match.group(1)), None)
    return list(seen)


def intruder_report(proc: Proc, key: NodeKey, superlink_log: str) -> dict[str, Any]:
    """How one intruder fared: its exit status, its refusal line, whether the SuperLink logged its
    key as refused, and how many messages (jobs, queries) it received."""
    assert proc.logfile is not None
    own_log = proc.logfile.read_text(errors="replace")
    stamp, refusal = next((line.split(" ", 1) for line in own_log.splitlines() if "[code: " in line), (None, None))
    key_refused = key.spki_base64() in refused_keys(superlink_log)
    return {
        "name": proc.name,
        "exit_code": proc.popen.poll(),
        "refusal": refusal,
        "refused_at": None if stamp is None else float(stamp),  # wall time (the log's line stamp)
        "superlink_refused_key": key_refused,
        "messages_received": sum(1 for line in own_log.splitlines() if "Receiving: " in line),
        "refused": not proc.alive() and refusal is not None and REFUSED in refusal and key_refused,
    }
