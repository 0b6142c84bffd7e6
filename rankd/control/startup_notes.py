"""A follower's start-up failure left as a file that rank 0 reads: the report that needs no torch.

A follower that fails before it can reach the job's store (torch itself fails to import, or the
store's client does) has no other way to tell rank 0, and its failed exit would make the launcher end
the kernel before the kernel said why. The ranks on rank 0's node share a directory named from what
the launcher gives every rank before any import: its process id (the ranks' parent), the run id and
the store's port. A note there reaches rank 0, which reports it as it reports a failure sent through
the store (:func:`shardbook.rankd.control.world.startup_errors`).

Ranks on other nodes see no directory of rank 0's node unless the launcher names one every node shares
(``SHARDBOOK_STARTUP_NOTES``, a folder on a shared filesystem): the Slurm launch names one beside its lease
on every node that sees the lease, the proof that the filesystem is shared (``kernel/slurm/node.py``). A job's
notes are then named by what every node's launcher gives alike (the run id, the store's address and port).
Without it, a rank on another node has only its own log line, and the store.

Standard library only: this module must import where torch does not.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

NOTES_ENV = "SHARDBOOK_STARTUP_NOTES"
"""A private folder that every node of the job sees (a shared filesystem), set by a launcher that knows one."""


def notes_dir() -> Path:
    """This job's directory of notes: the same for every rank the same launcher started (every node's launcher,
    in the shared folder)."""
    run, port = os.environ.get("TORCHELASTIC_RUN_ID", "none"), os.environ.get("MASTER_PORT", "0")
    if os.environ.get(NOTES_ENV):
        return _root() / "-".join((run, os.environ.get("MASTER_ADDR", "none"), port))
    return _root() / "startup" / "-".join((str(os.getppid()), run, port))


def reaches_rank_0() -> bool:
    """Whether a note this rank leaves reaches rank 0: a shared folder, or rank 0's node (torchrun's node 0, or
    shardbook's one-node launcher)."""
    return bool(os.environ.get(NOTES_ENV)) or os.environ.get("GROUP_RANK", "0") == "0"


def leave_note(rank: int, text: str) -> bool:
    """Leave ``text`` for rank 0 as rank ``rank``'s start-up failure; False if it cannot be left."""
    if not reaches_rank_0():
        return False
    folder = notes_dir()
    try:
        _private_dir(_root())
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        part = folder / f".rank-{rank}.{os.getpid()}"
        part.write_text(text, encoding="utf-8")
        part.replace(folder / f"rank-{rank}.txt")  # whole or absent: rank 0 never reads half a note
    except OSError:
        return False
    return True


def read_notes(world_size: int) -> dict[int, str]:
    """The notes the followers on this node left, by rank (none when the directory does not exist)."""
    notes = {}
    folder = notes_dir()
    for rank in range(1, world_size):
        try:
            notes[rank] = (folder / f"rank-{rank}.txt").read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
    return notes


def clear_notes() -> None:
    """Remove this job's notes (rank 0, once they can no longer matter: at its exit)."""
    shutil.rmtree(notes_dir(), ignore_errors=True)


def _root() -> Path:
    """The folder, private to this user, that holds this user's notes: the shared one, or this node's own."""
    shared = os.environ.get(NOTES_ENV)
    return Path(shared) if shared else Path(tempfile.gettempdir()) / f"shardbook-{os.getuid()}"


def _private_dir(path: Path) -> None:
    """Make ``path`` this user's own directory (mode 0700); raise OSError if another user's, or a link, holds it.

    The temporary directory is shared: a directory another local user made there first must not
    receive, or fake, this user's notes.
    """
    path.mkdir(mode=0o700, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise OSError(f"{path} is not a private directory of this user")
