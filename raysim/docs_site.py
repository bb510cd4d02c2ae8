"""`raysim docs`: the documentation site of the checkout, built when missing or older than its sources, served
on a free local port with Python's http.server until Ctrl-C."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from raysim.errors import RaysimError

ROOT = Path(__file__).resolve().parents[1]
"""The checkout: mkdocs.yml, docs/ and the site/ that `make docs` builds."""
SOURCES = ("mkdocs.yml", "docs", "raysim/reference.py")
"""What the site is built from (the configuration reference is generated from raysim's models by
raysim/reference.py at every build)."""


class DocsError(RaysimError):
    pass


def newest_source(root: Path = ROOT) -> float:
    """The last modification time of any file the site is built from."""
    times: list[float] = []
    for name in SOURCES:
        path = root / name
        files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
        times.extend(f.stat().st_mtime for f in files)
    return max(times)


def is_stale(site: Path, root: Path = ROOT) -> bool:
    """Whether the site is missing or older than one of its sources."""
    index = site / "index.html"
    return not index.is_file() or index.stat().st_mtime < newest_source(root)


def build(site: Path, root: Path = ROOT) -> None:
    """`mkdocs build --strict` of the checkout into `site` (what `make docs` runs); a failed build is one line
    naming the way to see why."""
    if not (root / "mkdocs.yml").is_file():
        raise DocsError(f"{root / 'mkdocs.yml'} not found: `raysim docs` serves the site of a source checkout")
    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.is_file():
        raise DocsError("mkdocs is not installed here: run `make docs` in the checkout (it installs the dev tools)")
    print(f"building the documentation site into {site} (mkdocs build --strict, about a minute)", flush=True)
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(site)], cwd=root, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        last = next(iter(reversed(done.stderr.strip().splitlines())), "no output")
        raise DocsError(f"mkdocs build failed ({last.strip()}): run `make docs` to see why")


def serve(site: Path, host: str, port: int) -> None:
    """Serve `site` on (host, port) until Ctrl-C or SIGTERM, after printing the link to open."""
    from raysim.errors import sigterm_interrupts

    handler = functools.partial(_QuietHandler, directory=str(site))
    with ThreadingHTTPServer((host, port), handler) as server, sigterm_interrupts():
        print(f"documentation site {site} on http://{host}:{port} (until Ctrl-C)", flush=True)
        print(f"open http://{host}:{port}/index.html", flush=True)
        server.serve_forever()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        """No line per request on the terminal."""
