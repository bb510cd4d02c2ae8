"""Where the checkout is, for tests that read its files (configs, docs, the package's source) or run in it."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The checkout's root folder."""
