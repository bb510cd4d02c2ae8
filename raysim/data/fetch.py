"""Make sure Fashion-MNIST is available locally (run by `make run` / `make test`).

Order: already present in one of the loader's places -> nothing to do; else, as root on Debian,
install the `dataset-fashion-mnist` package; else let torchvision download it (needs internet).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from raysim.data.fashion_mnist import load_fashion_mnist
from raysim.errors import DataError

APT_LOCK_WAIT_S = 600
"""How long apt-get waits for another apt process (unattended upgrades on a fresh cloud machine) to release dpkg's
lock, instead of failing at once with "Could not get lock /var/lib/dpkg/lock-frontend" (apt's own switch
`DPkg::Lock::Timeout`, apt 1.9.11 and later; it says "Waiting for cache lock" meanwhile)."""


def apt_get(*arguments: str) -> list[str]:
    """The apt-get command line that waits up to APT_LOCK_WAIT_S for the dpkg lock (the Makefile's `tools` too)."""
    return ["apt-get", "-o", f"DPkg::Lock::Timeout={APT_LOCK_WAIT_S}", *arguments]


def _apt_install() -> bool:
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return False
    print("Fashion-MNIST missing: installing the Debian package dataset-fashion-mnist", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(apt_get("update"), check=False, stdout=subprocess.DEVNULL, env=env)
    install = apt_get("install", "-y", "dataset-fashion-mnist")
    return subprocess.run(install, check=False, stdout=subprocess.DEVNULL, env=env).returncode == 0


def main() -> int:
    try:
        load_fashion_mnist(download=False)
        return 0
    except DataError:
        pass
    try:
        if _apt_install():
            load_fashion_mnist(download=False)
        else:
            load_fashion_mnist(download=True)
    except DataError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
