"""Which message a reply answers, and from which node: the rule every reply must pass.

Flower matches a reply to its message by ``reply_to_message_id``, and its SuperLink stores a reply
only if its ``src_node_id`` is the node the message was sent to (``LinkState.store_message_res``);
a reply it refuses is never seen by the ServerApp, and the message waits until its TTL.

Two checks here hold the same rule on every transport:

- ``mismatch`` is the in-process Grid's (``InProcessGrid._execute``): a ClientApp's reply that
  answers another message, no message at all, or claims another node, is replaced at once by an
  error reply to the right message, whose reason says what happened and what to do
  (``unmatched_error``). Its code is the stray reply's own when it was an error (LocalDpMod's
  refusals are code 6, MOD_FAILED_PRECONDITION), else 0 (UNKNOWN). So the job fails at once,
  where Flower's runtimes would leave it to its TTL.
- ``from_node`` is the client manager's (``Transport.accept``), whatever the Grid: a reply is read
  as the answer to a message sent to node n only if it comes from n, or if it is an error that the
  SuperLink sent itself (``src_node_id`` = ``SUPERLINK_NODE_ID``: an expired message, a node that
  went away). Any other reply is a stray (``wrong-node``): it is not the victim's outcome, and the
  victim's job stays in flight for its own reply or its TTL.

The usual cause of a reply to no message is a mod that builds its error on the handler's reply
instead of on the message: Flower's ``LocalDpMod`` answers ``Message(Error(...), reply_to=out_msg)``
when the handler's reply does not hold exactly one ArrayRecord with the keys it was sent. A
``ClientApp(mods=[...])``'s mods wrap every handler (``app.train(mods=[...])`` adds its own to
them: ``make_ffn(fn, app._mods + mods)``), so such a mod on the whole ClientApp also sees the
replies of ``@app.evaluate`` and ``@app.query``, which hold no ArrayRecord.
"""

from __future__ import annotations

from typing import Any

from flwr.app import Error, Message
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode

from .errors import one_line


def from_node(reply: Message, node_id: int) -> bool:
    """Whether ``reply`` may answer a message sent to node ``node_id``: it comes from that node, or it
    is an error reply the SuperLink sent itself."""
    src = reply.metadata.src_node_id
    return src == node_id or (src == SUPERLINK_NODE_ID and reply.has_error())


def mismatch(msg: Message, reply: Any) -> str | None:
    """Why ``reply`` (what a ClientApp returned for ``msg``) is not a reply to ``msg`` from its node,
    with what to do about it; None when it is."""
    node, mid = msg.metadata.dst_node_id, msg.metadata.message_id
    if not isinstance(reply, Message):
        return f"node {node}'s ClientApp returned a {type(reply).__name__}, not a Message"
    meta = reply.metadata
    if reply is msg:
        return (f"node {node}'s ClientApp returned the message it was given instead of a reply; build one "
                "with Message(content, reply_to=message)")
    if not meta.reply_to_message_id:
        return _no_message(node, msg.metadata.message_type, reply)
    if meta.reply_to_message_id != mid:
        return (f"node {node}'s ClientApp answered message {mid!r} with a reply to message "
                f"{meta.reply_to_message_id!r} (node {meta.src_node_id}'s); the reply was dropped. A "
                "reply must be built with Message(content, reply_to=<the message the handler was given>)")
    if meta.src_node_id != node:
        return (f"the reply to message {mid!r} claims to come from node {meta.src_node_id}, but the "
                f"message went to node {node}; the reply was dropped")
    return None


def _no_message(node: int, message_type: str, reply: Message) -> str:
    handler = message_type.split(".", 1)[0]
    what = (f"node {node}'s ClientApp returned a reply to no message (empty reply_to_message_id): a mod "
            "replied to the handler's reply, not to the message, as LocalDpMod does when a reply lacks "
            "exactly one ArrayRecord with the keys sent. ")
    if handler == "train":
        what += "Return exactly one ArrayRecord from @app.train (metrics in a MetricRecord)."
    else:
        what += (f"ClientApp(mods=[...]) wraps every handler, @app.{handler} too: attach the mod to "
                 "@app.train(mods=[...]) instead.")
    if reply.has_error():
        what += f" (It was an error, code {reply.error.code}: {one_line(reply.error.reason, 120)})"
    return what


def unmatched_error(msg: Message, reply: Any, why: str) -> Message:
    """The error reply to ``msg`` that stands for ``reply``, which did not answer it (``why``)."""
    code = ErrorCode.UNKNOWN
    if isinstance(reply, Message) and reply.has_error() and type(reply.error.code) is int:
        code = reply.error.code
    return Message(Error(code=code, reason=why), reply_to=msg)
