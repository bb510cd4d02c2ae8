"""User-facing errors. The CLI prints them as one line and exits non-zero; no traceback."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class RaysimError(Exception):
    """Base class of errors caused by input (config, data), not by a bug."""


class ConfigError(RaysimError):
    """A config value is invalid; the message starts with the key path."""


class DataError(RaysimError):
    """A dataset could not be found or read; the message names the files and places tried."""


class PartitionError(RaysimError):
    """A partition cannot be made from this dataset; the message names the config fields."""


class Interrupted(KeyboardInterrupt):
    """The user stopped the program (Ctrl-C, SIGTERM); the message says what became of the run.

    A KeyboardInterrupt, so that every layer unwinds as for Ctrl-C and nothing that handles a failed trial
    or input error swallows it; the CLI prints it as one line and exits with 128 + the signal number."""

    def __init__(self, message: str = "", signal_number: int = 2):
        super().__init__(message)
        self.signal_number = signal_number


def _raise_interrupted(signum: int, _frame: object) -> None:
    raise Interrupted("", signum)


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Inside: SIGTERM raises Interrupted in the main thread, as Ctrl-C raises KeyboardInterrupt, so that a
    run ends the same way for both (marked KILLED, no traceback). Elsewhere than the main thread: no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
