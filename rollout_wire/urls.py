"""URLs as they may be shown: a Redis URL can carry a password."""

from __future__ import annotations

import urllib.parse

# Query parameters whose value is a secret (redis-py reads ?password=).
_SECRET_PARAMS = frozenset({"password"})


def redacted(url: str) -> str:
    """`url` with its password (if any) replaced by `***`, for messages and logs.

    Works on every form ROLLOUT_REDIS_URL takes: one host (redis://, rediss://), a list of
    Sentinels (sentinel://:pw@h1:26379,h2:26379/0?master=m), and kombu's `;`-joined form."""
    return ";".join(_redacted_one(part) for part in url.split(";"))


def _redacted_one(url: str) -> str:
    if "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    # Split by hand: urllib cannot parse a netloc holding several host:port pairs.
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    netloc, tail = rest[:end], rest[end:]
    userinfo, at, hosts = netloc.rpartition("@")
    if at:
        user, colon, _secret = userinfo.partition(":")
        if colon:
            netloc = f"{user}:***@{hosts}"
    return f"{scheme}://{netloc}{_redacted_query(tail)}"


def _redacted_query(tail: str) -> str:
    path, question, rest = tail.partition("?")
    if not question:
        return tail
    query, hash_, fragment = rest.partition("#")
    pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
    if not any(name in _SECRET_PARAMS for name, _ in pairs):
        return tail
    masked = [(n, "***" if n in _SECRET_PARAMS else v) for n, v in pairs]
    return f"{path}?{urllib.parse.urlencode(masked, safe='/*')}{hash_}{fragment}"
