"""ROLLOUT_REDIS_URL read once: a plain Redis URL, or a set of Sentinels that names the master.

Forms (every client of the project accepts each of them):

- ``redis://[[user]:password@]host:port/db`` and ``rediss://...?ssl_cert_reqs=required&
  ssl_ca_certs=...`` (TLS), ``unix:///path?db=N``: one Redis, as redis-py and Celery read them.
- ``sentinel://[[user]:password@]host1:26379[,host2:26379,...]/db?master=NAME``: Redis
  Sentinel. The clients ask the Sentinels which node is the master of ``NAME`` and follow a
  failover. The password (and user) authenticate to the data nodes; the Sentinels are asked
  without one.
- ``sentinel+rediss://...same.../db?master=NAME[&ssl_cert_reqs=required][&ssl_ca_certs=PATH]
  [&ssl_certfile=PATH][&ssl_keyfile=PATH][&sentinel_tls=no]``: the same, with TLS to the data
  nodes and to the Sentinels (``sentinel_tls=no``: Sentinels in clear text, data nodes in TLS).
  ``ssl_cert_reqs`` defaults to ``required``.

The parsing is pure (this module imports no Redis client at import time); `redis_client` builds
a redis-py client bound to the current master, `celery_settings` the broker and result-backend
settings that kombu's ``sentinel`` transport and Celery's ``SentinelBackend`` read.

No error raised here shows any piece of the password, whatever the URL holds: a URL whose
``user:password@`` part has a raw ``/``, ``?`` or ``#`` is refused before anything else is read
(every parser cuts the password there and would quote the rest as a host, port or path), and
messages quote only what follows the credentials.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollout_wire.errors import ConfigError
from rollout_wire.urls import shown_scheme

if TYPE_CHECKING:  # pragma: no cover - types only
    import redis

PLAIN_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_SCHEME = "sentinel"
SENTINEL_TLS_SCHEME = "sentinel+rediss"
SENTINEL_SCHEMES = (SENTINEL_SCHEME, SENTINEL_TLS_SCHEME)
DEFAULT_SENTINEL_PORT = 26379

SSL_PARAMS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
CERT_REQS = ("required", "optional", "none")
_YES = {"yes": True, "true": True, "1": True, "no": False, "false": False, "0": False}


@dataclass(frozen=True)
class SentinelURL:
    """A parsed Sentinel URL."""

    hosts: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    # ssl_* options for the TLS connections (data nodes, and Sentinels when sentinel_tls).
    ssl: tuple[tuple[str, str], ...] = ()
    sentinel_tls: bool = False

    @property
    def ssl_options(self) -> dict[str, str]:
        return dict(self.ssl)

    def master_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of redis-py's `Sentinel.master_for` for the data nodes."""
        kwargs: dict[str, Any] = {"db": self.db}
        if self.username:
            kwargs["username"] = self.username
        if self.password is not None:
            kwargs["password"] = self.password
        if self.tls:
            kwargs["ssl"] = True
            kwargs.update(self.ssl_options)
        return kwargs

    def sentinel_kwargs(self) -> dict[str, Any]:
        """Connection arguments for the Sentinel nodes themselves (TLS only)."""
        return {"ssl": True, **self.ssl_options} if self.sentinel_tls else {}


def scheme_of(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else ""


def is_sentinel(url: str) -> bool:
    return scheme_of(url) in SENTINEL_SCHEMES


def check_url(url: str) -> None:
    """Raise ConfigError unless `url` is one of the accepted forms (see the module doc)."""
    scheme = scheme_of(url)
    if scheme in SENTINEL_SCHEMES:
        parse_sentinel(url)
    elif scheme not in PLAIN_SCHEMES:
        raise ConfigError(
            f"Redis URL scheme {shown_scheme(url) or '(none)'} is not one of "
            "redis://, rediss://, unix://, sentinel://, sentinel+rediss://"
        )
    else:
        _check_credentials(url)


def _check_credentials(url: str) -> None:
    """Refuse a URL with an '@' after its host part: the password holds a raw '/', '?' or '#'
    (or a parameter a raw '@'), and wherever a parser cuts it, a piece of it would show as a
    host, a port or a path in some message."""
    rest = url.split("://", 1)[1]
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    if "@" in rest[end:]:
        raise ConfigError(
            f"the {shown_scheme(url)} URL has an '@' after its host part: percent-encode '/', "
            "'?', '#' and '@' in the user name and password (%2F, %3F, %23, %40), and '@' in "
            "parameters"
        )


def _split_host(item: str) -> tuple[str, int]:
    if item.startswith("["):  # [IPv6]:port
        host, _, rest = item[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else rest
    else:
        host, _, port_text = item.rpartition(":") if ":" in item else (item, "", "")
    if not host:
        raise ConfigError(f"Sentinel address {item!r} has no host")
    if not port_text:
        return host, DEFAULT_SENTINEL_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"Sentinel address {item!r} has no valid port")
    return host, int(port_text)


def parse_sentinel(url: str) -> SentinelURL:
    """Parse a ``sentinel://`` or ``sentinel+rediss://`` URL; ConfigError says what is wrong
    (the password never appears in the message)."""
    scheme = scheme_of(url)
    if scheme not in SENTINEL_SCHEMES:
        shown = shown_scheme(url) or "(none)"
        raise ConfigError(f"not a Sentinel URL (sentinel:// or sentinel+rediss://): {shown}")
    _check_credentials(url)  # first: the messages below quote what follows the credentials
    rest = url.split("://", 1)[1]
    rest, _, fragment = rest.partition("#")
    if fragment:
        raise ConfigError("a Sentinel URL takes no #fragment; name the master with ?master=NAME")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hostlist = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = urllib.parse.unquote(user) or None
        password = urllib.parse.unquote(secret) if colon else None
    hosts = tuple(_split_host(item.strip()) for item in hostlist.split(",") if item.strip())
    if not hosts:
        raise ConfigError("a Sentinel URL needs at least one host:port of a Sentinel")
    path = path.strip("/")
    if path and not path.isdigit():
        raise ConfigError(f"the database of a Sentinel URL must be a number, not {path!r}")
    db = int(path) if path else 0
    params: dict[str, str] = {}
    for name, value in urllib.parse.parse_qsl(query, keep_blank_values=True):
        if name in params:
            raise ConfigError(f"Sentinel URL parameter {name!r} given twice")
        params[name] = value
    master = params.pop("master", "")
    if not master:
        raise ConfigError("a Sentinel URL needs the master's name: ?master=NAME")
    tls = scheme == SENTINEL_TLS_SCHEME
    ssl = {name: params.pop(name) for name in SSL_PARAMS if name in params}
    sentinel_tls_text = params.pop("sentinel_tls", None)
    if params:
        raise ConfigError(
            f"unknown Sentinel URL parameter(s) {sorted(params)}; known: master, "
            f"{', '.join(SSL_PARAMS)}, sentinel_tls"
        )
    if not tls and (ssl or sentinel_tls_text is not None):
        raise ConfigError(
            "TLS parameters in a sentinel:// URL: use sentinel+rediss:// for TLS "
            f"({sorted([*ssl, *(['sentinel_tls'] if sentinel_tls_text is not None else [])])})"
        )
    sentinel_tls = False
    if tls:
        ssl.setdefault("ssl_cert_reqs", "required")
        if ssl["ssl_cert_reqs"].lower() not in CERT_REQS:
            raise ConfigError(f"ssl_cert_reqs must be one of {', '.join(CERT_REQS)}")
        ssl["ssl_cert_reqs"] = ssl["ssl_cert_reqs"].lower()
        text = (sentinel_tls_text or "yes").lower()
        if text not in _YES:
            raise ConfigError(f"sentinel_tls must be yes or no, not {sentinel_tls_text!r}")
        sentinel_tls = _YES[text]
    return SentinelURL(
        hosts=hosts,
        master=master,
        db=db,
        username=username,
        password=password,
        tls=tls,
        ssl=tuple(sorted(ssl.items())),
        sentinel_tls=sentinel_tls,
    )


def redis_client(url: str, **kwargs: Any) -> redis.Redis:
    """A redis-py client for `url`. For a Sentinel URL it is bound to the current master: every
    new connection asks the Sentinels where the master is, so it follows a failover (a command
    that was on the old master's connection fails with ConnectionError, like any outage).

    `kwargs` are redis-py connection arguments (socket_timeout, health_check_interval...);
    the socket_* ones also apply to the connections to the Sentinels."""
    import redis as redis_lib

    if not is_sentinel(url):
        if "://" in url:
            _check_credentials(url)  # redis-py's errors quote a cut password as the port
        return redis_lib.Redis.from_url(url, **kwargs)
    from redis.sentinel import Sentinel

    parsed = parse_sentinel(url)
    sentinel_kwargs = {k: v for k, v in kwargs.items() if k.startswith("socket_")}
    sentinel_kwargs.update(parsed.sentinel_kwargs())
    sentinel = Sentinel(list(parsed.hosts), sentinel_kwargs=sentinel_kwargs, **kwargs)
    return sentinel.master_for(parsed.master, **parsed.master_kwargs())


def master_address(url: str, *, socket_timeout: float = 2.0) -> tuple[str, int] | None:
    """Where the Sentinels of `url` say the master is now (None: no Sentinel answered)."""
    from redis.sentinel import MasterNotFoundError, Sentinel

    parsed = parse_sentinel(url)
    kwargs: dict[str, Any] = {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": socket_timeout,
    }
    sentinel = Sentinel(list(parsed.hosts), sentinel_kwargs=kwargs | parsed.sentinel_kwargs())
    try:
        host, port = sentinel.discover_master(parsed.master)
        return str(host), int(port)
    except MasterNotFoundError:
        return None
    finally:
        for node in sentinel.sentinels:
            node.close()


def _kombu_url(parsed: SentinelURL, host: str, port: int) -> str:
    auth = ""
    if parsed.username or parsed.password is not None:
        user = urllib.parse.quote(parsed.username or "", safe="")
        secret = urllib.parse.quote(parsed.password or "", safe="")
        auth = f"{user}:{secret}@"
    address = f"[{host}]" if ":" in host else host
    return f"sentinel://{auth}{address}:{port}/{parsed.db}"


def celery_settings(url: str) -> dict[str, Any]:
    """The Celery settings that point the broker and the result backend at `url`.

    A plain URL is used as it is. A Sentinel URL becomes what kombu's ``sentinel`` transport
    and Celery's ``sentinel`` result backend read: one ``sentinel://`` URL per Sentinel joined
    by ``;`` (each with the credentials: kombu switches to the next on failure and reads them
    from that one), ``master_name`` (and ``sentinel_kwargs`` for TLS Sentinels) in both
    transport options, and ``broker_use_ssl`` / ``redis_backend_use_ssl`` for TLS data nodes.
    The caller merges its own transport options with these.
    """
    if not is_sentinel(url):
        return {
            "broker_url": url,
            "result_backend": url,
            "broker_transport_options": {},
            "result_backend_transport_options": {},
        }
    parsed = parse_sentinel(url)
    joined = ";".join(_kombu_url(parsed, host, port) for host, port in parsed.hosts)
    options: dict[str, Any] = {"master_name": parsed.master}
    if parsed.sentinel_tls:
        options["sentinel_kwargs"] = parsed.sentinel_kwargs()
    settings: dict[str, Any] = {
        "broker_url": joined,
        "result_backend": joined,
        "broker_transport_options": dict(options),
        "result_backend_transport_options": dict(options),
    }
    if parsed.tls:
        settings["broker_use_ssl"] = parsed.ssl_options
        settings["redis_backend_use_ssl"] = parsed.ssl_options
    return settings
