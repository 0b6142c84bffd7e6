"""The control-plane protocol: message types, the envelope, signing sessions and endpoints.

Rank 0 and the followers exchange ``jupyter_client.session.Session`` messages signed with the
kernel's HMAC key (a message whose signature does not verify is dropped and logged, never acted
on). Every message's content is an envelope ``{"v": PROTOCOL_VERSION, "id": ..., "rank": ...,
"payload": {...}}``; the message type is the Session ``msg_type``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardbook.rankd.control import text

log = logging.getLogger(__name__)
PROTOCOL_VERSION = 1

# rank 0 -> followers
COMMAND = "command"  # payload: {"kind": handler name, "args": {...}}
INTERRUPT = "interrupt"  # raise KeyboardInterrupt in the follower running command `id` (payload calls_only: only in
# the user functions it calls, see user_calls: the continuous batch's rows of one cell)
SHUTDOWN = "shutdown"  # leave the follower loop and exit

# followers -> rank 0
HELLO = "hello"  # payload: the follower's static facts (host, pid, device, backend)
HEARTBEAT = "heartbeat"  # payload: {"memory": {...}}
STREAM = "stream"  # payload: {"name": "stdout"|"stderr", "text": str}
DISPLAY = "display"  # payload: {"data": mimebundle, "metadata": {...}, "transient": {...}}
RESULT = "result"  # payload: {"data": mimebundle, "metadata": {...}} -- the cell's last value
ERROR = "error"  # payload: {"ename", "evalue", "traceback": [str]}
DONE = "done"  # payload: {"status": "ok"|"error", "value": json-able or None}
PROGRESS = "progress"  # payload: {"step": str, "done": int, "total": int} -- a long command's progress
TEXT = "text"  # payload: {"text": str} -- a chunk of a streamed reply

OUTPUT_TYPES = (STREAM, DISPLAY, RESULT, ERROR, PROGRESS, TEXT)
CONTROL_KEY = "shardbook/control"  # torch.distributed store key holding rank 0's endpoint
KEY_ENV = "SHARDBOOK_KEY"
KEY_FILE_ENV = "SHARDBOOK_KEY_FILE"


class ProtocolError(ValueError):
    """A message that is well signed but not something this version understands."""


def positive_number_env(name: str, default: float) -> float:
    """A positive, finite number from the environment (a setting such as a timeout); the default, with a
    warning, for anything else."""
    text = os.environ.get(name, "")
    try:
        value = float(text) if text else default
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        log.warning("%s=%r is not a positive number; using the default, %g", name, text[:40], default)
        return default
    return value


def new_id() -> str:
    return uuid.uuid4().hex[:12]


def envelope(payload: dict[str, Any] | None = None, *, id: str = "", rank: int = 0) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": id, "rank": rank, "payload": payload or {}}


def unsendable(msg_type: str, content: dict[str, Any], error: Exception) -> tuple[str, dict[str, Any]]:
    """What goes out instead of a message whose content could not be serialised (JSON only, no text surprises).

    A command's reply becomes an error reply, so the command still ends; output becomes a line
    on stderr saying what was lost, so it is not lost silently.
    """
    why = f"{type(error).__name__} while serialising it: {error}"
    if msg_type == DONE:
        error_payload = {
            "ename": "UnsendableReply",
            "evalue": f"the rank's reply could not be sent ({why})",
            "traceback": [],
        }
        payload: dict[str, Any] = {"status": "error", "error": error_payload}
    else:
        msg_type, payload = (
            STREAM,
            {"name": "stderr", "text": f"[shardbook] a {msg_type!r} output was dropped ({why})\n"},
        )
    return msg_type, envelope(payload, id=str(content.get("id", "")), rank=int(content.get("rank", 0)))


@dataclass(frozen=True)
class Message:
    """A verified, parsed control-plane message."""

    type: str
    id: str
    rank: int
    payload: dict[str, Any]

    @classmethod
    def from_session_msg(cls, msg: dict[str, Any]) -> Message:
        """The message in a verified Session dict; ProtocolError for any other shape (never KeyError...)."""
        content = msg.get("content")
        header = msg.get("header")
        msg_type = header.get("msg_type") if isinstance(header, dict) else None
        if not isinstance(content, dict) or not isinstance(msg_type, str):
            raise ProtocolError("no envelope or no message type")
        version = content.get("v")
        if version != PROTOCOL_VERSION:
            shown = version if type(version) is int and abs(version) < 1000 else "(another format)"
            raise ProtocolError(
                f"protocol version {shown} received, {PROTOCOL_VERSION} expected: "
                "every rank must run the same shardbook version"
            )
        id_, rank, payload = content.get("id", ""), content.get("rank", 0), content.get("payload") or {}
        if not isinstance(id_, str) or type(rank) is not int or not isinstance(payload, dict):
            raise ProtocolError(
                "an envelope field of the wrong type (id must be text, rank an integer, payload a mapping)"
            )
        return cls(type=msg_type, id=id_, rank=rank, payload=payload)


def pack(obj: Any) -> bytes:
    """A message part as UTF-8 JSON, like jupyter_client's packer, but never failing on text.

    jupyter_client's packer raises UnicodeEncodeError on a lone surrogate (``print("\\ud800")``
    on a follower would end its I/O thread) and sends surrogate-escaped bytes as invalid UTF-8;
    here every such character goes out as U+FFFD, so both ends hold the same valid text.
    """
    encoder = _encoder()
    try:
        packed = encoder.encode(obj)
    except (TypeError, ValueError):  # what jupyter_client also retries: NaN, sets, other near-JSON values
        from jupyter_client.jsonutil import json_clean

        packed = encoder.encode(json_clean(obj))
    return packed.encode("utf-8", text.REPLACE_ERRORS)


@functools.cache
def _encoder() -> json.JSONEncoder:
    """One encoder for every message part: ``json.dumps`` with these options builds a new one per call (a
    third of the cost of signing a small message)."""
    from jupyter_client.session import json_default

    return json.JSONEncoder(default=json_default, ensure_ascii=False, allow_nan=False)


def make_session(key: bytes, signature_scheme: str = "hmac-sha256"):
    """A Session that signs with ``key`` and packs with :func:`pack`;
    an empty key is refused (it would sign nothing)."""
    from jupyter_client.session import Session

    if not key:
        raise ValueError(
            "the control plane needs an HMAC key: start the kernel from Jupyter (the connection file "
            f"holds one) or set {KEY_ENV} / {KEY_FILE_ENV} on every node"
        )
    return Session(
        key=key, signature_scheme=signature_scheme, username="shardbook", check_pid=False, packer=f"{__name__}.pack"
    )


def read_connection_key(connection_file: str | os.PathLike) -> tuple[bytes, str]:
    """The HMAC key and signature scheme from a Jupyter connection file."""
    info = json.loads(Path(connection_file).read_text())
    return info.get("key", "").encode(), info.get("signature_scheme", "hmac-sha256")


def key_from_environment() -> bytes | None:
    """A key given to followers on other nodes: ``$SHARDBOOK_KEY_FILE`` or ``$SHARDBOOK_KEY``."""
    path = os.environ.get(KEY_FILE_ENV)
    if path:
        return read_key_file(path)
    key = os.environ.get(KEY_ENV)
    return key.encode() if key else None


def read_key_file(path: str | os.PathLike) -> bytes:
    try:
        key = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(
            f"cannot read the control-plane key file {path}: {e.strerror}; copy it from the kernel's node"
        ) from e
    if not key:
        raise ValueError(f"the key file {path} is empty; run `shardbook install` with --key-file to create one")
    return key.encode()


def control_key(
    *, key_file: str | os.PathLike | None = None, connection_file: str | os.PathLike | None = None, session: Any = None
) -> tuple[bytes, str] | None:
    """The control-plane key and signature scheme from the first source that has one, in this order.

    An explicit key file (``--key-file``), then ``$SHARDBOOK_KEY_FILE`` / ``$SHARDBOOK_KEY`` (how
    followers on other nodes get it), then the kernel's connection file, then a kernel's own
    ``Session``. None when no source has a key; every rank and command looks its key up here.
    """
    if key_file:
        return read_key_file(key_file), "hmac-sha256"
    key = key_from_environment()
    if key:
        return key, "hmac-sha256"
    if connection_file:
        return read_connection_key(connection_file)
    if session is not None and session.key:
        return session.key, session.signature_scheme
    return None
