"""The built documentation site as a reader opens it, in headless Chromium: from the file system (site/index.html)
and served by `raysim docs`. Every internal link lands on a page (no directory listing, no 404), search finds
"rho", the mermaid diagram renders as SVG (no network: the scripts are vendored). The site is built once."""

from __future__ import annotations

import base64
import html
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.xdist_group("system-docs_site")
"""One worker runs this module's tests: the site is built once."""

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site as `make docs` builds it (mkdocs build --strict), into a temporary folder."""
    built = tmp_path_factory.mktemp("docs") / "site"
    mkdocs = Path(sys.executable).parent / "mkdocs"
    done = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(built)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return built


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.links += [value for name, value in attrs if name in ("href", "src") and value]


def internal_links(site: Path) -> dict[Path, list[str]]:
    """Every page's relative links (not to another site, not a bare #anchor). Not of 404.html: a server's page
    for any missing path, whose links are from the site's root by design (no page links to it)."""
    pages = {}
    for page in sorted(set(site.rglob("*.html")) - {site / "404.html"}):
        parser = _Links()
        parser.feed(page.read_text())
        pages[page] = [link for link in parser.links if not urlsplit(link).scheme and not link.startswith("#")]
    return pages


def test_every_internal_link_of_the_site_lands_on_a_file_not_a_folder(site):
    pages = internal_links(site)
    broken = []
    for page, links in pages.items():
        targets = {(page.parent / unquote(urlsplit(link).path)).resolve() for link in links}
        broken += [
            f"{page.relative_to(site)}: {link}"
            for link in links
            if not (page.parent / unquote(urlsplit(link).path)).resolve().is_file()
        ]
        assert set(pages) - {page} <= targets, f"{page.name} does not link to every page (the navigation)"
    assert not broken, broken[:20]
    assert len(pages) >= 14 and sum(map(len, pages.values())) > 300  # the 14 pages of the nav
    assert not [p for p in site.rglob("index.html") if p.parent != site]  # pages are page.html, no folder/index.html


def test_the_api_reference_is_generated_from_the_docstrings(site):
    """docs/api.md: the entry points, each with its signature and its docstring's text."""
    from raysim.algorithms.interface import Algorithm
    from raysim.api import Result, run
    from raysim.registry import Registry

    page = (site / "api.html").read_text()
    for entry in (
        "raysim.api.run",
        "raysim.api.run_suite",
        "raysim.api.Result",
        "raysim.api.Result.history",
        "raysim.registry.Registry.register",
        "raysim.algorithms.interface.Algorithm.client_step",
        "raysim.algorithms.interface.Algorithm.server_step",
    ):
        assert f'id="{entry}"' in page, entry
    text = re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", "", page)))
    for documented in (run, Result, Registry, Algorithm):
        first = re.sub(r"`", "", (documented.__doc__ or "").strip().split("\n")[0])
        assert first[:60] in text, first


def _chromium_binary() -> str:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    assert binary, "headless Chromium is needed: `make setup` installs Debian's chromium package"
    return binary


class DevTools:
    """Headless Chromium driven through its DevTools protocol over a pipe (--remote-debugging-pipe: fd 3 in,
    fd 4 out, one JSON message per NUL-terminated record), so closed shadow roots (where Material draws
    mermaid's SVG) can be read with DOM.getDocument(pierce)."""

    def __init__(self, profile: Path) -> None:
        to_browser, self._in = os.pipe()
        self._out, from_browser = os.pipe()

        def wire() -> None:  # in the child: the pipe's ends as fds 3 and 4 (through fds above both, never clobbered)
            high = max(to_browser, from_browser, 4) + 1
            os.dup2(to_browser, high)
            os.dup2(from_browser, high + 1)
            os.dup2(high, 3)
            os.dup2(high + 1, 4)

        options = [
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1400,900",
            "--remote-debugging-pipe",
            f"--user-data-dir={profile}",
            "about:blank",
        ]
        self.process = subprocess.Popen(
            [_chromium_binary(), *options],
            preexec_fn=wire,
            pass_fds=(3, 4),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        os.close(to_browser)
        os.close(from_browser)
        self._buffer, self._next = b"", 0
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]

    def call(self, method: str, session: str | None = None, **params: object) -> dict:
        self._next += 1
        message = {"id": self._next, "method": method, "params": params} | ({"sessionId": session} if session else {})
        os.write(self._in, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in self._buffer:
                chunk = os.read(self._out, 1 << 20)
                assert chunk, f"Chromium closed its DevTools pipe during {method}"
                self._buffer += chunk
            record, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(record)
            if reply.get("id") == self._next:
                assert "error" not in reply, (method, reply["error"])
                return reply["result"]

    def page(self, method: str, **params: object) -> dict:
        return self.call(method, self.session, **params)

    def open(self, url: str) -> None:
        self.page("Page.navigate", url=url)

    def until(self, check, what: str, timeout_s: float = 60.0):
        """check()'s first truthy value, polled every half second."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            time.sleep(0.5)
        raise AssertionError(f"{what}: not within {timeout_s:.0f} s")

    def text(self, expression: str) -> str:
        return self.page("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value") or ""

    def mermaid_svgs(self) -> int:
        """The SVG elements inside the shadow roots of the page's mermaid blocks."""
        tree = self.page("DOM.getDocument", depth=-1, pierce=True)["root"]
        return sum(
            _count(root, "svg")
            for host in _nodes(tree)
            if "mermaid" in _classes(host)
            for root in host.get("shadowRoots", [])
        )

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.page("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        os.killpg(self.process.pid, signal.SIGTERM)
        self.process.wait(timeout=30)
        os.close(self._in)
        os.close(self._out)


def _nodes(node: dict):
    yield node
    for child in [*node.get("children", []), *node.get("shadowRoots", [])]:
        yield from _nodes(child)


def _classes(node: dict) -> list[str]:
    attributes = node.get("attributes", [])
    pairs = zip(attributes[::2], attributes[1::2], strict=True)  # DOM.Node.attributes: [name, value, ...]
    return next((value.split() for name, value in pairs if name == "class"), [])


def _count(node: dict, name: str) -> int:
    return sum(1 for child in _nodes(node) if child.get("nodeName", "").lower() == name)


def _read_like_a_reader(base: str, tmp_path: Path, shot_name: str) -> None:
    """At `base` (the site's index.html): search for "rho" with Material's ?q=, the mermaid diagram on the front
    page, and a link followed from the front page to the Algorithms page, screenshotted."""
    browser = DevTools(tmp_path / f"profile-{shot_name}")
    try:
        browser.open(f"{base}?q=rho")
        meta = "document.querySelector('.md-search-result__meta')?.textContent || ''"
        found = browser.until(lambda: re.search(r"(\d+) matching documents?", browser.text(meta)), "search for rho")
        assert int(found[1]) >= 3, found[0]
        results = browser.text("[...document.querySelectorAll('.md-search-result__link')].map(a => a.href).join(' ')")
        assert "algorithms.html" in results, results
        browser.screenshot(tmp_path / f"{shot_name}-search.png")
        assert browser.until(browser.mermaid_svgs, "the mermaid diagram as SVG") == 1
        nav = "[...document.querySelectorAll('.md-sidebar--primary a')]"
        href = browser.text(f"{nav}.find(a => a.textContent.trim() === 'Algorithms').href")
        assert href.endswith("/algorithms.html"), href
        browser.open(href)
        title = browser.until(lambda: browser.text("document.querySelector('article h1')?.textContent"), "a page")
        assert title.strip().startswith("Algorithms"), title
        browser.screenshot(shot := tmp_path / f"{shot_name}-algorithms.png")
        assert shot.read_bytes()[:8] == PNG and shot.stat().st_size > 30_000
        print(f"screenshots: {tmp_path}")
    finally:
        browser.close()


@pytest.mark.slow
def test_from_the_file_system_search_finds_rho_the_diagram_renders_and_links_open_pages(site, tmp_path):
    _read_like_a_reader((site / "index.html").as_uri(), tmp_path, "file")


@pytest.mark.slow
def test_raysim_docs_serves_the_site_on_a_free_port_where_it_works_the_same(site, tmp_path):
    process = subprocess.Popen(
        [sys.executable, "-m", "raysim.cli", "docs", "--site", str(site)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("open "):
                break
        link = lines[-1].removeprefix("open ").strip()
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/index\.html", link), lines
        assert not any(line.startswith("building") for line in lines), lines  # the fresh site is not rebuilt
        base = link.removesuffix("index.html")
        for page in sorted(site.glob("*.html")):
            with urllib.request.urlopen(base + page.name, timeout=10) as response:
                assert response.status == 200 and b"md-content" in response.read(), page.name
        _read_like_a_reader(link, tmp_path, "served")
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        assert process.wait(timeout=30) == 128 + signal.SIGTERM
