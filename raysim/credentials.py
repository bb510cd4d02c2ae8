"""Credentials in a tracking URI stay in the process that uses them.

A `tracking.uri` such as `http://user:pw@host:5000` or `postgresql://user:pw@db/mlflow` must never be
written to MLflow params or tags (the command line, the description), artifacts, checkpoint manifests, a Ray
job's runtime environment or the console, wherever it came from (the config, `--set`, `--tracking-uri`,
$MLFLOW_TRACKING_URI). `redact` is what every stored or printed URI goes through, `redact_text` every stored or
printed text. The user info ends at the last `@` before the host: a password typed with a raw `@` (or, in a
database URI, a raw `/`) is hidden whole. For an HTTP server, `connect_uri` moves the
user info into MLflow's own variables (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD; a token is
MLFLOW_TRACKING_TOKEN) and returns the URI without it; a database URI keeps its password, which
SQLAlchemy needs, and is only ever shown redacted.
"""

from __future__ import annotations

import os
import re
from urllib.parse import unquote, urlsplit, urlunsplit

REDACTED = "***"
_DATABASE_USERINFO = re.compile(
    r"(?P<scheme>\b(?:postgres(?:ql)?|mysql|mariadb|mssql|oracle|cockroachdb)(?:\+[\w.]+)?://)[^?\s]*@"
)
"""SQLAlchemy's URLs: the password runs to the last `@` before the query (it may hold a `/`)."""
_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.\-]*://)[^/\s]*@")
"""Any other URL: the user info runs to the last `@` before the path."""


def redact(uri: str | None) -> str | None:
    """The URI with any `user:password@` replaced by `***@` (unchanged if it has none)."""
    if not uri:
        return uri
    return redact_text(uri)


def redact_text(text: str) -> str:
    """Any URI with user info inside a longer text (an error message, a command line, a YAML dump), redacted."""
    text = _DATABASE_USERINFO.sub(rf"\g<scheme>{REDACTED}@", text)
    return _USERINFO.sub(rf"\g<scheme>{REDACTED}@", text)


def has_credentials(uri: str | None) -> bool:
    return uri is not None and redact_text(uri) != uri


def is_redacted(uri: str | None) -> bool:
    """Whether a URI is one `redact` produced (its credentials must come from elsewhere)."""
    return uri is not None and f"://{REDACTED}@" in uri


def connect_uri(uri: str) -> str:
    """The URI MLflow should be given. For http(s) with user info: the user info moves into
    MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (a bare `token@` into MLFLOW_TRACKING_TOKEN) of this
    process, and the URI without it is returned. A redacted http(s) URI (a resumed run, a shipped job) is
    returned without the `***@`: the credentials must then already be in those variables."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or "@" not in parts.netloc:
        return uri
    userinfo, _, host = parts.netloc.rpartition("@")
    bare = urlunsplit(parts._replace(netloc=host))
    if userinfo == REDACTED:
        return bare
    user, colon, password = userinfo.partition(":")
    if colon:
        os.environ["MLFLOW_TRACKING_USERNAME"] = unquote(user)
        os.environ["MLFLOW_TRACKING_PASSWORD"] = unquote(password)
    else:
        os.environ["MLFLOW_TRACKING_TOKEN"] = unquote(user)
    return bare
