"""User-facing errors. The CLI prints them as one line and exits non-zero; no traceback."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal, NoReturn


class RaysimError(Exception):
    """Base class of errors caused by input (config, data), not by a bug."""


class ConfigError(RaysimError):
    """A config value is invalid; the message starts with the key path."""


class DataError(RaysimError):
    """A dataset could not be found or read; the message names the files and places tried."""


class PartitionError(RaysimError):
    """A partition cannot be made from this dataset; the message names the config fields."""


class CheckpointError(RaysimError):
    """A checkpoint is missing, incomplete or unreadable; the message names the path."""


class OutputError(RaysimError):
    """A file or folder a command was told to write cannot be written there; the message names the option."""


def check_output(path: str | Path, key: str, kind: Literal["file", "folder"]) -> Path:
    """Refuse, in one line starting with `key` (the option or field that named it), a place a command is to write
    before its work starts (a teacher trained for hours, then a traceback at the rename): a folder where a file goes,
    a file where a folder goes, a path below a regular file, a place that cannot be written (read-only, not
    permitted). Nothing is left behind: no folder is created, and the probe file written into the nearest existing
    folder is removed at once. Returns the path, `~` expanded."""
    path = Path(path).expanduser()
    if kind == "file" and path.is_dir():
        raise OutputError(f"{key} {path}: a folder; give the file to write")
    if kind == "folder" and path.exists() and not path.is_dir():
        raise OutputError(f"{key} {path}: a file, not a folder")
    existing = nearest_existing(path if kind == "folder" and path.is_dir() else path.parent)
    if not existing.is_dir():
        raise OutputError(f"{key} {path}: {existing} is a file, not a folder")
    reason = unwritable(existing)
    if reason is not None:
        raise OutputError(f"{key} {path}: cannot be written in {existing} ({reason})")
    return path


def nearest_existing(path: Path) -> Path:
    """`path` if it exists, else its nearest existing parent (what a write below it would land in)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def unwritable(folder: Path) -> str | None:
    """Why a file cannot be created in the existing `folder` (the OS's words), or None when it can; the probe file
    is removed at once."""
    try:
        handle, probe = tempfile.mkstemp(dir=folder, prefix=".raysim-probe-")
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        return error.strerror
    return None


class Interrupted(KeyboardInterrupt):
    """The user stopped the program (Ctrl-C, SIGTERM, SIGHUP); the message says what became of the run.

    A KeyboardInterrupt, so that every layer unwinds as for Ctrl-C and nothing that handles a failed trial
    or input error swallows it; the CLI prints it as one line and exits with 128 + the signal number."""

    def __init__(self, message: str = "", signal_number: int = 2):
        super().__init__(message)
        self.signal_number = signal_number


class RayLost(KeyboardInterrupt):
    """The local Ray this process started died under it (its GCS server or raylet exited: killed, out of memory).
    Raised in the main thread wherever it is, so that every layer unwinds as for Ctrl-C and nothing that handles
    a failed trial swallows it; the driver marks its run FAILED and the CLI prints the message as one `error:`
    line (exit 1)."""


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""The signals that stop a run as Ctrl-C does: SIGTERM (`kill`, a batch scheduler, a container stop, `ray job
stop`) and SIGHUP (a closed terminal or SSH session)."""


_raised: list[KeyboardInterrupt] = []
"""The interruption a signal handler raised last and nobody has taken yet (see `as_raised`)."""


def raise_from_handler(interrupt: KeyboardInterrupt) -> NoReturn:
    """Raise `interrupt` from a signal handler, remembered for `as_raised`."""
    _raised[:] = [interrupt]
    raise interrupt


def as_raised(interrupt: KeyboardInterrupt) -> KeyboardInterrupt:
    """The interruption a signal handler raised, when `interrupt` is the bare KeyboardInterrupt that Ray's blocking
    calls (ray.get, ray.wait) raise in its place: they catch any KeyboardInterrupt raised inside them, ours
    included, and raise a new one. Otherwise `interrupt` itself. Either way the remembered one is taken."""
    raised = _raised.pop() if _raised else None
    return raised if raised is not None and type(interrupt) is KeyboardInterrupt else interrupt


def raise_pending() -> None:
    """Raise again an interruption that a signal handler raised and Python dropped: a handler that runs while the
    main thread is inside a weakref callback or a `__del__` (Ray's object references have one) raises there, and
    Python prints the exception as "Exception ignored" and goes on; a Ctrl-C was lost that way and the run went on.
    Loops that run for long (the rounds, a sweep's wait) call it at each turn."""
    if _raised:
        raise _raised.pop()


def _raise_interrupted(signum: int, _frame: object) -> None:
    raise_from_handler(Interrupted("", signum))


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Inside: SIGTERM and SIGHUP (STOP_SIGNALS), and Ctrl-C unless SIGINT is ignored (a background job), raise
    Interrupted in the main thread, remembered for `raise_pending` should Python drop it, so that a run ends the
    same way for all three (marked KILLED, no traceback). Elsewhere than the main thread: no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    numbers = [*STOP_SIGNALS]
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        numbers.append(signal.SIGINT)
    previous = {number: signal.signal(number, _raise_interrupted) for number in numbers}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
