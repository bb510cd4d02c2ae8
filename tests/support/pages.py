"""The plugin files docs/extending.md shows, as the page gives them."""

from __future__ import annotations

import re

from tests.support.paths import ROOT

PAGE = ROOT / "docs" / "extending.md"


FILE_BLOCK = re.compile(r"<!-- file: (\S+) -->\n```\w+\n(.*?)\n```", re.S)


def page_files() -> dict[str, str]:
    """The files docs/extending.md shows (`<!-- file: NAME -->` before a code block), by name."""
    return {name: text + "\n" for name, text in FILE_BLOCK.findall(PAGE.read_text())}
