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

Those variables stay in the process that writes to MLflow, the driver: the processes of a local Ray it starts
(GCS server, raylet, and through the raylet every worker: hosts, coordinator, a sweep's trials) are started
`without_credentials` (raysim.runtime.session). A sweep's trial, which writes its own run from a Ray worker, is
lent the driver's credentials for the time it runs (`held`, `lent`), and gives them back after.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
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


VARIABLES = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
"""Where MLflow reads a tracking server's credentials from (connect_uri moves a URI's user info there)."""


def without_credentials(environment: Mapping[str, str]) -> dict[str, str]:
    """`environment` for a process that must not hold the tracking credentials: without VARIABLES, and with a
    MLFLOW_TRACKING_URI that has user info redacted."""
    kept = {key: value for key, value in environment.items() if key not in VARIABLES}
    if has_credentials(kept.get("MLFLOW_TRACKING_URI")):
        kept["MLFLOW_TRACKING_URI"] = redact_text(kept["MLFLOW_TRACKING_URI"])
    return kept


def held() -> dict[str, str]:
    """The tracking credentials this process holds in its environment (VARIABLES that are set)."""
    return {key: os.environ[key] for key in VARIABLES if key in os.environ}


@contextmanager
def lent(credentials: Mapping[str, str]) -> Iterator[None]:
    """Inside: this process's environment holds `credentials` (and whatever connect_uri moves there); afterwards
    VARIABLES are as they were, so that a Ray worker that wrote one trial's run keeps none of them."""
    before = held()
    os.environ.update(credentials)
    try:
        yield
    finally:
        for key in VARIABLES:
            os.environ.pop(key, None)
        os.environ.update(before)
