"""Signals as a terminal delivers them to a program the tests start."""

from __future__ import annotations

import signal


def sigint_as_from_a_terminal() -> None:
    """Ctrl-C as a terminal delivers it (a `preexec_fn`): a test suite started in the background by a
    non-interactive shell (`make test &`) has SIGINT ignored, and an ignored SIGINT stays ignored in every program
    it starts."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
