"""URLs as they may be shown: a Redis URL can carry a password."""

from __future__ import annotations

import urllib.parse


def redacted(url: str) -> str:
    """`url` with its password (if any) replaced by `***`, for messages and logs."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    netloc = f"{user}:***@{host}{port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
