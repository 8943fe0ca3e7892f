"""One process per run: a lock file next to the run's checkpoint, holding the pid of
the process that trains it.

:func:`run_lock` takes the lock with ``flock`` (the kernel releases it when the holder
dies, however it dies) and writes the holder's pid and host into the file. A second
process asking for the same run while the holder lives gets :class:`RunLockedError`
naming the run, the holder's pid and the lock file; a lock file left by a process that
no longer runs (killed) is taken over with a warning. The file is removed when the
holder lets go. Processes that share the run must share the filesystem's locks (one
host).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

__all__ = ["RunLockedError", "run_lock"]

log = logging.getLogger(__name__)


class RunLockedError(ValueError):
    """Another live process trains the run."""


def _holder(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 200).decode(errors="replace").strip()


def _acquire(path: Path, run: str) -> int:
    """The open, locked descriptor of ``path`` (the file that ``path`` names now)."""
    for _ in range(5):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd) or "another process"
            os.close(fd)
            raise RunLockedError(
                f"{run} is being trained by {holder} (lock file {path}); wait for "
                "it or stop it first: two processes on one run would write the same "
                "checkpoint") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the previous holder removed it meanwhile: lock the new one
    raise RunLockedError(f"{run}: could not take the lock file {path}")


@contextlib.contextmanager
def run_lock(path: str | os.PathLike, run: str = "the run") -> Iterator[Path]:
    """Hold the lock file ``path`` for the ``with`` block (``run`` names the run in
    messages). Raises :class:`RunLockedError` when a live process holds it."""
    path = Path(path)
    made = [d for d in path.parents if not d.exists()]  # removed again if left empty
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = _acquire(path, run)
    except RunLockedError:
        _remove_empty(made)
        raise
    try:
        old = _holder(fd)
        if old:
            log.warning("%s: lock file %s of %s, which no longer runs, taken over",
                        run, path, old)
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, f"process {os.getpid()} on {socket.gethostname()}\n".encode())
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        os.close(fd)
        _remove_empty(made)


def _remove_empty(folders: list[Path]) -> None:
    """Remove ``folders`` (innermost first) as long as they are empty."""
    for d in folders:
        try:
            d.rmdir()
        except OSError:
            return
