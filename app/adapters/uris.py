"""Remote adapter URIs: which are remote, their one normalized form, and what lies under a root. A URI, and every
redirect a read of it follows, is served only under one of the configured roots, judged on this form, so the
server cannot be made to fetch arbitrary URLs."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from app.errors import AdapterPathOutsideRoots

REMOTE_SCHEMES = ("s3", "gs", "hf", "http", "https")
_SCHEME_ALIASES = {"gcs": "gs", "s3a": "s3"}
_URI_RE = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<rest>.*)", re.DOTALL)
_FORBIDDEN = re.compile(r"[\x00-\x20\x7f\\?#]")  # control characters, spaces, backslashes, queries, fragments
MAX_REDIRECTS = 5  # hops one HTTP request may take, each to a target under the adapter roots


def is_remote(path: str | Path) -> bool:
    """Whether `path` names a remote adapter (a URI with a scheme other than file://)."""
    match = _URI_RE.match(str(path))
    return match is not None and match["scheme"].lower() != "file"


def normalize_uri(uri: str) -> str:
    """The URI in the one form that containment is judged on, or ValueError saying what is wrong with it.

    Lower-case scheme (gcs:// and s3a:// as gs:// and s3://), no trailing slash; refused: an unknown scheme,
    credentials (user@host), a query or fragment, '.' / '..' / empty segments, backslashes, control characters,
    and in http(s) URIs any '%' (a percent-encoded '..' or '/' would pass the check here and be decoded by the
    server)."""
    match = _URI_RE.fullmatch(uri)
    if match is None:
        raise ValueError(f"{uri!r} is not a URI")
    scheme = _SCHEME_ALIASES.get(match["scheme"].lower(), match["scheme"].lower())
    if scheme not in REMOTE_SCHEMES:
        raise ValueError(f"{uri!r}: scheme {scheme!r} is not served; use one of {', '.join(REMOTE_SCHEMES)}")
    rest = match["rest"].rstrip("/")
    if _FORBIDDEN.search(rest):
        raise ValueError(f"{uri!r}: spaces, control characters, backslashes, queries and fragments are refused")
    segments = rest.split("/")
    if "@" in segments[0] or (":" in segments[0] and scheme not in ("http", "https")):
        raise ValueError(f"{uri!r}: credentials in a URI are refused; they come from the environment")
    if scheme in ("http", "https") and "%" in rest:
        raise ValueError(f"{uri!r}: percent-encoding is refused in http(s) adapter URIs")
    if any(s in ("", ".", "..") for s in segments):
        raise ValueError(f"{uri!r}: empty, '.' and '..' path segments are refused")
    host = segments[0].lower() if scheme in ("http", "https") else segments[0]
    return f"{scheme}://{'/'.join([host, *segments[1:]])}"


def _containment_form(uri: str) -> str:
    # hf://org/repo@revision/... lies under the root hf://org/repo: the revision is not a folder.
    if uri.startswith("hf://"):
        segments = uri[len("hf://"):].split("/")
        repo_at = 2 if segments[0] in ("datasets", "spaces", "models") else 1
        if len(segments) > repo_at:
            segments[repo_at] = segments[repo_at].split("@", 1)[0]
        return "hf://" + "/".join(segments)
    return uri


def is_under(uri: str, root: str) -> bool:
    if _containment_form(root) == root:  # a root that names a Hub revision admits that revision only
        uri = _containment_form(uri)
    return uri == root or uri.startswith(root + "/")


def check_redirect(roots: Sequence[str], source: str, target: str, hops: int) -> None:
    """AdapterPathOutsideRoots unless the redirect from `source` to `target`, the `hops`-th of one request, may be
    followed: the roots hold for every URL a read goes to, not only for the one a client names."""
    if hops > MAX_REDIRECTS:
        raise AdapterPathOutsideRoots(f"{source}: more than {MAX_REDIRECTS} redirects")
    try:
        normalized = normalize_uri(target)
    except ValueError:
        normalized = None
    if normalized is None or not any(is_under(normalized, root) for root in roots):
        raise AdapterPathOutsideRoots(f"{source}: redirect to {target} leaves the adapter roots {list(roots)}")
