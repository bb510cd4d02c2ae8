"""`make run` on a fresh cloud machine, where unattended upgrades hold dpkg's lock: the set-up's apt-get
(Fashion-MNIST's package, raysim.data.fetch; the Makefile's `tools`) waits for the lock instead of failing at once.
Real apt-get on a private dpkg folder (its lock file held by this test as another apt process holds it): no root
needed."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import threading
import time

import pytest

from raysim.data.fetch import APT_LOCK_WAIT_S, apt_get
from tests.support.paths import ROOT

pytestmark = pytest.mark.skipif(shutil.which("apt-get") is None, reason="a Debian machine's apt-get")


def _private_dpkg(tmp_path) -> list[str]:
    """apt-get options that point its dpkg state (and so the lock it takes) into `tmp_path`."""
    for folder in ("lists/partial", "archives/partial", "dpkg/updates"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "dpkg" / "status").touch()
    return [
        *("-o", f"Dir::State::status={tmp_path / 'dpkg' / 'status'}"),
        *("-o", f"Dir::State::Lists={tmp_path / 'lists'}"),
        *("-o", f"Dir::Cache::Archives={tmp_path / 'archives'}"),
        *("-o", f"Dir::Log={tmp_path}"),
    ]


def test_the_set_ups_apt_get_waits_for_another_apt_processes_lock(tmp_path):
    """With the lock held, plain apt-get fails at once; the set-up's waits ("Waiting for cache lock") and goes on
    as soon as the holder lets go, here after 2 s."""
    options = _private_dpkg(tmp_path)
    holder = open(tmp_path / "dpkg" / "lock-frontend", "w")  # noqa: SIM115 - released by the thread below
    fcntl.lockf(holder, fcntl.LOCK_EX)
    env = {**os.environ, "LANG": "C", "LC_ALL": "C"}
    plain = subprocess.run(["apt-get", *options, "check"], capture_output=True, text=True, env=env, timeout=60)
    assert plain.returncode != 0 and "Could not get lock" in plain.stderr
    threading.Timer(2.0, holder.close).start()  # the upgrade ends
    started = time.monotonic()
    command = apt_get(*options, "check")
    waited = subprocess.run(command, capture_output=True, text=True, env=env, timeout=APT_LOCK_WAIT_S + 60)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    assert "Waiting for cache lock" in waited.stdout + waited.stderr and time.monotonic() - started >= 1.5


def test_the_makefiles_apt_get_is_the_same_command():
    """The Makefile's `tools` (Chromium, TeX) runs apt-get as raysim.data.fetch does."""
    assert f"APT := {' '.join(apt_get())}\n" in (ROOT / "Makefile").read_text()
    assert "&& apt-get " not in (ROOT / "Makefile").read_text()  # every apt-get call through $(APT)
