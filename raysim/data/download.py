"""Download and unpack dataset files, for the file-backed sources (idx, cifar, ...).

Downloads land in a temporary file next to the target and are renamed into place only when complete and,
if an md5 is given, verified: an interrupted or corrupt download never leaves a file under the final name.
Files already present are used as they are (checksums guard downloads, not the user's own copies).
"""

from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import tarfile
import tempfile
import urllib.request
import zipfile
from pathlib import Path

from raysim.errors import DataError

_CHUNK = 1 << 20


def default_root() -> Path:
    """Where datasets live when `dataset.root` is not set: $RAYSIM_DATA, else ~/.cache/raysim/data."""
    configured = os.environ.get("RAYSIM_DATA")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "raysim" / "data"


def resolve_root(root: str | Path | None) -> Path:
    """`dataset.root` as a path, falling back to `default_root()`."""
    return Path(root).expanduser() if root else default_root()


def fetch(url: str, target: Path, md5: str | None = None, timeout: float = 60.0) -> Path:
    """Download `url` to `target` (atomically; checked against `md5` when given) unless `target` exists."""
    target = Path(target)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    digest = hashlib.md5()
    try:
        with os.fdopen(handle, "wb") as out:
            try:
                with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (URLs come from code)
                    while chunk := response.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
            except (OSError, http.client.HTTPException, ValueError) as error:
                reason = getattr(error, "reason", None) or error
                raise DataError(
                    f"{url}: download failed ({reason}); this machine may be offline: "
                    f"place the files under dataset.root ({target.parent}) instead"
                ) from None
        if md5 is not None and digest.hexdigest() != md5.lower():
            raise DataError(
                f"{url}: checksum mismatch (md5 {digest.hexdigest()}, expected {md5.lower()}); the file was not kept"
            )
        os.replace(temporary, target)
    finally:
        Path(temporary).unlink(missing_ok=True)
    return target


def _inside(into: Path, name: str, archive: Path) -> Path:
    """The destination of archive member `name`, refusing absolute paths and `..` escapes."""
    destination = (into / name).resolve()
    if destination != into and into not in destination.parents:
        raise DataError(f"{archive}: member {name!r} would be written outside {into}; refusing to extract")
    return destination


def extract(archive: Path, into: Path) -> None:
    """Unpack a .tar.gz/.tgz/.tar or .zip archive into `into`: regular files and folders only (no links, no
    device files), and no member may land outside `into`."""
    archive, into = Path(archive), Path(into)
    into.mkdir(parents=True, exist_ok=True)
    into = into.resolve()
    name = archive.name.lower()
    try:
        if name.endswith(".zip"):
            with zipfile.ZipFile(archive) as bundle:
                for info in bundle.infolist():
                    destination = _inside(into, info.filename, archive)
                    if info.is_dir():
                        destination.mkdir(parents=True, exist_ok=True)
                        continue
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    with bundle.open(info) as source, open(destination, "wb") as out:
                        shutil.copyfileobj(source, out, _CHUNK)
            return
        if name.endswith((".tar.gz", ".tgz", ".tar")):
            with tarfile.open(archive, "r:*") as bundle:
                for member in bundle.getmembers():
                    destination = _inside(into, member.name, archive)
                    if member.isdir():
                        destination.mkdir(parents=True, exist_ok=True)
                        continue
                    if not member.isfile():
                        raise DataError(f"{archive}: member {member.name!r} is not a regular file; refusing to extract")
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    content = bundle.extractfile(member)
                    assert content is not None  # regular files always have content
                    with content, open(destination, "wb") as out:
                        shutil.copyfileobj(content, out, _CHUNK)
            return
    except (OSError, EOFError, tarfile.TarError, zipfile.BadZipFile) as error:
        raise DataError(f"{archive}: cannot extract ({error})") from None
    raise DataError(f"{archive}: unknown archive type; allowed: .tar.gz, .tgz, .tar, .zip")
