"""MkDocs hook: the configuration reference page is generated from raysim's pydantic models at every build."""

from __future__ import annotations

from mkdocs.structure.files import File, Files


def on_files(files: Files, config) -> Files:
    from raysim.reference import config_reference

    files.append(File.generated(config, "reference.md", content=config_reference()))
    return files
