"""URLs as they may be shown: a Redis URL can carry a password."""

from __future__ import annotations

import re
import urllib.parse

# Query parameters whose value is a secret (redis-py reads ?password=).
_SECRET_PARAMS = frozenset({"password"})
SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
# kombu's form joins whole URLs with ';': split only where a new URL starts, so that a ';' in
# a password does not end its URL early (and leave the rest of the password unmasked).
_NEXT_URL = re.compile(r";(?=[A-Za-z][A-Za-z0-9+.-]*://)")


def redacted(url: str) -> str:
    """`url` with its password (if any) replaced by `***`, for messages and logs.

    Works on every form ROLLOUT_REDIS_URL takes: one host (redis://, rediss://), a list of
    Sentinels (sentinel://:pw@h1:26379,h2:26379/0?master=m), and kombu's `;`-joined form; and
    on malformed ones: no piece of a password shows, whatever characters it holds."""
    return ";".join(_redacted_one(part) for part in _NEXT_URL.split(url))


def shown_scheme(url: str) -> str:
    """The scheme of `url` as it may be shown ("redis://"), or "" when it has none that looks
    like one (text before '://' that is no scheme may be part of a password)."""
    match = SCHEME.match(url)
    return match.group(0) if match else ""


def _redacted_one(url: str) -> str:
    # The credentials are everything before the last '@': a raw '/', '?', '#' or '@' in a
    # password must not decide where they end (URL parsers cut there, and would show the rest).
    before, at, after = url.rpartition("@")
    if not at:
        scheme = shown_scheme(url)
        if not scheme:
            return url
        return scheme + _redacted_tail(url[len(scheme) :])
    scheme = shown_scheme(before)
    user, colon, _secret = before[len(scheme) :].partition(":")
    # Without a ':' there is no user name to keep: the lone part may be a password.
    shown_user = f"{user}:" if colon else ""
    return f"{scheme}{shown_user}***@{_redacted_tail(after)}"


def _redacted_tail(rest: str) -> str:
    """Hosts, path, query: a ?password= value masked."""
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    return rest[:end] + _redacted_query(rest[end:])


def _redacted_query(tail: str) -> str:
    path, question, rest = tail.partition("?")
    if not question:
        return tail
    query, _hash, _fragment = rest.partition("#")
    pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
    if not any(name in _SECRET_PARAMS for name, _ in pairs):
        return tail
    masked = [(n, "***" if n in _SECRET_PARAMS else v) for n, v in pairs]
    # The fragment goes too: a raw '#' in the password would have started it.
    return f"{path}?{urllib.parse.urlencode(masked, safe='/*')}"
