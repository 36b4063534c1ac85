"""ROLLOUT_REDIS_URL forms: plain Redis URLs pass through unchanged, Sentinel URLs are parsed
once into a redis-py client bound to the master and into the settings kombu and Celery read.
Nothing here connects: clients are built and inspected."""

from __future__ import annotations

import re

import pytest

from rollout_wire.errors import ConfigError
from rollout_wire.redis_url import (
    DEFAULT_SENTINEL_PORT,
    celery_settings,
    check_url,
    is_sentinel,
    parse_sentinel,
    redis_client,
)
from rollout_wire.urls import redacted

SENTINEL = "sentinel://:s3cret@10.0.0.1:26379,10.0.0.2:26380,sentinel-c/2?master=rollout"
TLS = (
    "sentinel+rediss://app:s3cret@s1.example:26379,s2.example:26379/0?master=rollout"
    "&ssl_ca_certs=/etc/rollout/redis-tls/ca.crt"
)


# -- parsing --------------------------------------------------------------------------------
def test_a_sentinel_url_names_every_sentinel_the_master_and_the_database():
    parsed = parse_sentinel(SENTINEL)
    assert parsed.hosts == (
        ("10.0.0.1", 26379),
        ("10.0.0.2", 26380),
        ("sentinel-c", DEFAULT_SENTINEL_PORT),
    )
    assert (parsed.master, parsed.db) == ("rollout", 2)
    assert (parsed.username, parsed.password) == (None, "s3cret")
    assert not parsed.tls and not parsed.sentinel_tls and parsed.ssl_options == {}
    assert parsed.master_kwargs() == {"db": 2, "password": "s3cret"}
    assert parsed.sentinel_kwargs() == {}


def test_hosts_may_be_ipv6_and_the_database_defaults_to_zero():
    parsed = parse_sentinel("sentinel://[::1]:26390,[fe80::2]/?master=m")
    assert parsed.hosts == (("::1", 26390), ("fe80::2", DEFAULT_SENTINEL_PORT))
    assert parsed.db == 0
    assert parse_sentinel("sentinel://h?master=m").db == 0


def test_a_percent_encoded_password_and_a_user_are_decoded():
    parsed = parse_sentinel("sentinel://app:p%40ss%3Aw@h:1/0?master=m")
    assert (parsed.username, parsed.password) == ("app", "p@ss:w")
    assert "p@ss" not in repr(parsed)  # the password never shows in a repr


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("sentinel://h1:26379,h2:26379/0", "master's name"),
        ("sentinel://h1:26379/0?master=", "master's name"),
        ("sentinel:///0?master=m", "at least one host"),
        ("sentinel://h1:port/0?master=m", "no valid port"),
        ("sentinel://h1:70000/0?master=m", "no valid port"),
        ("sentinel://h1/zero?master=m", "must be a number"),
        ("sentinel://h1/0?master=m&mastr=x", "unknown Sentinel URL parameter"),
        ("sentinel://h1/0?master=m&master=n", "given twice"),
        ("sentinel://h1/0#m", "no #fragment"),
        ("sentinel://h1/0?master=m&ssl_ca_certs=/ca.crt", "use sentinel+rediss://"),
        ("sentinel+rediss://h1/0?master=m&ssl_cert_reqs=maybe", "ssl_cert_reqs"),
        ("sentinel+rediss://h1/0?master=m&sentinel_tls=perhaps", "sentinel_tls"),
    ],
)
def test_a_bad_sentinel_url_is_refused_saying_why(url, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_sentinel(url)
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_url(url)


def test_an_error_never_shows_the_password():
    with pytest.raises(ConfigError) as caught:
        parse_sentinel("sentinel://:hunter2@h1:bad/0?master=m")
    assert "hunter2" not in str(caught.value)


def test_the_tls_form_uses_tls_to_data_nodes_and_sentinels_verifying_by_default():
    parsed = parse_sentinel(TLS)
    assert parsed.tls and parsed.sentinel_tls
    assert parsed.ssl_options == {
        "ssl_cert_reqs": "required",  # the default: certificates are checked
        "ssl_ca_certs": "/etc/rollout/redis-tls/ca.crt",
    }
    assert parsed.master_kwargs() == {
        "db": 0,
        "username": "app",
        "password": "s3cret",
        "ssl": True,
        "ssl_cert_reqs": "required",
        "ssl_ca_certs": "/etc/rollout/redis-tls/ca.crt",
    }
    assert parsed.sentinel_kwargs() == {"ssl": True, **parsed.ssl_options}
    plain_sentinels = parse_sentinel(TLS + "&sentinel_tls=no&ssl_cert_reqs=NONE")
    assert plain_sentinels.tls and not plain_sentinels.sentinel_tls
    assert plain_sentinels.sentinel_kwargs() == {}
    assert plain_sentinels.ssl_options["ssl_cert_reqs"] == "none"


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "redis://:pw@redis:6379/3",
        "rediss://:pw@r.example:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/ca.crt",
        "unix:///run/redis.sock?db=1",
    ],
)
def test_plain_urls_are_accepted_and_passed_through_unchanged(url):
    assert not is_sentinel(url)
    check_url(url)
    assert celery_settings(url) == {
        "broker_url": url,
        "result_backend": url,
        "broker_transport_options": {},
        "result_backend_transport_options": {},
    }


@pytest.mark.parametrize("url", ["http://h:1/0", "h:6379", "amqp://guest@h//", ""])
def test_other_schemes_are_refused(url):
    with pytest.raises(ConfigError, match="is not one of"):
        check_url(url)


# -- shown, masked -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (SENTINEL, SENTINEL.replace(":s3cret@", ":***@")),
        (TLS, TLS.replace("app:s3cret@", "app:***@")),
        (
            "sentinel://:a@h1:1/0;sentinel://:a@h2:2/0",
            "sentinel://:***@h1:1/0;sentinel://:***@h2:2/0",
        ),
        ("redis://:s3cret@10.0.0.1:6380/0", "redis://:***@10.0.0.1:6380/0"),
        ("rediss://app:s3cret@redis.example/1", "rediss://app:***@redis.example/1"),
        ("redis://h/0?password=s3cret&db=1", "redis://h/0?password=***&db=1"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("sentinel://h1,h2/0?master=m", "sentinel://h1,h2/0?master=m"),
    ],
)
def test_redacted_masks_the_password_of_every_form(url, shown):
    assert redacted(url) == shown
    assert "s3cret" not in redacted(url)


def test_settings_accept_a_sentinel_url_and_mask_the_password_of_a_bad_one():
    from rollout_worker.settings import Settings

    assert Settings(redis_url=SENTINEL).redis_url == SENTINEL
    assert Settings(redis_url=TLS).redis_url == TLS
    with pytest.raises(ConfigError, match="master's name") as caught:
        Settings(redis_url="sentinel://:s3cret@h1:26379/0")
    assert "s3cret" not in str(caught.value) and ":***@" in str(caught.value)
    with pytest.raises(ConfigError, match="is not one of"):
        Settings(redis_url="http://:s3cret@h/0")


# -- the redis-py client -------------------------------------------------------------------
def test_the_client_of_a_sentinel_url_asks_the_sentinels_for_the_master():
    from redis.sentinel import SentinelConnectionPool, SentinelManagedConnection

    client = redis_client(SENTINEL, socket_timeout=2, health_check_interval=30)
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    assert pool.service_name == "rollout"
    assert pool.connection_class is SentinelManagedConnection
    kwargs = pool.connection_kwargs
    assert (kwargs["db"], kwargs["password"], kwargs["health_check_interval"]) == (2, "s3cret", 30)
    assert kwargs["socket_timeout"] == 2
    sentinels = pool.sentinel_manager.sentinels
    addresses = [
        (s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
        for s in sentinels
    ]
    assert addresses == [("10.0.0.1", 26379), ("10.0.0.2", 26380), ("sentinel-c", 26379)]
    # The Sentinels get the socket timeouts, never the data nodes' password.
    for node in sentinels:
        assert node.connection_pool.connection_kwargs.get("password") is None
        assert node.connection_pool.connection_kwargs["socket_timeout"] == 2


def test_the_client_of_the_tls_form_uses_tls_to_master_and_sentinels():
    from redis.connection import SSLConnection
    from redis.sentinel import SentinelManagedSSLConnection

    pool = redis_client(TLS).connection_pool
    assert pool.connection_class is SentinelManagedSSLConnection
    assert pool.connection_kwargs["ssl_ca_certs"] == "/etc/rollout/redis-tls/ca.crt"
    assert pool.connection_kwargs["username"] == "app"
    for node in pool.sentinel_manager.sentinels:
        assert issubclass(node.connection_pool.connection_class, SSLConnection)


def test_a_plain_url_gives_the_client_redis_py_would_give():
    client = redis_client("redis://:pw@10.1.2.3:6390/4", socket_timeout=3)
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["host"], kwargs["port"], kwargs["db"], kwargs["password"]) == (
        "10.1.2.3",
        6390,
        4,
        "pw",
    )
    assert kwargs["socket_timeout"] == 3


# -- what Celery and kombu make of the settings (the installed versions, no connection) ----
def test_celery_settings_of_a_sentinel_url_are_what_kombu_and_celery_read():
    settings = celery_settings(SENTINEL)
    chunks = settings["broker_url"].split(";")
    assert chunks == [
        "sentinel://:s3cret@10.0.0.1:26379/2",
        "sentinel://:s3cret@10.0.0.2:26380/2",
        "sentinel://:s3cret@sentinel-c:26379/2",
    ]
    assert settings["result_backend"] == settings["broker_url"]
    assert settings["broker_transport_options"] == {"master_name": "rollout"}
    assert settings["result_backend_transport_options"] == {"master_name": "rollout"}
    assert "broker_use_ssl" not in settings and "redis_backend_use_ssl" not in settings
    tls = celery_settings(TLS)
    assert tls["broker_use_ssl"] == tls["redis_backend_use_ssl"] == parse_sentinel(TLS).ssl_options
    assert tls["broker_transport_options"] == {
        "master_name": "rollout",
        "sentinel_kwargs": {"ssl": True, **parse_sentinel(TLS).ssl_options},
    }


def test_the_worker_app_keeps_its_options_and_hands_kombu_and_celery_the_sentinels():
    from kombu.transport.redis import SentinelTransport

    from rollout_worker.celery_app import create_app
    from rollout_worker.settings import Settings

    app = create_app(Settings(redis_url=SENTINEL, visibility_timeout=40), with_tasks=False)
    transport = app.conf.broker_transport_options
    assert transport["master_name"] == "rollout"
    assert (transport["visibility_timeout"], transport["unacked_restore_interval"]) == (40, 10)
    assert app.conf.result_backend_transport_options == {
        "master_name": "rollout",
        "visibility_timeout": 40,
    }
    assert app.conf.task_acks_late and app.conf.accept_content == ["json"]
    with app.connection_for_write() as conn:
        assert conn.transport.__class__ is SentinelTransport
        assert conn.transport_options["master_name"] == "rollout"
        assert [u.split("@")[1] for u in conn.alt] == [
            "10.0.0.1:26379/2",
            "10.0.0.2:26380/2",
            "sentinel-c:26379/2",
        ]
        assert (conn.password, conn.virtual_host) == ("s3cret", "2")
    backend = app.backend
    assert type(backend).__name__ == "SentinelBackend"
    assert [(h["host"], h["port"]) for h in backend.connparams["hosts"]] == [
        ("10.0.0.1", 26379),
        ("10.0.0.2", 26380),
        ("sentinel-c", 26379),
    ]
    assert (backend.connparams["db"], backend.connparams["password"]) == (2, "s3cret")
    assert "s3cret" not in backend.as_uri()
    app.close()


def test_a_plain_url_leaves_the_worker_app_as_it_was():
    from rollout_worker.celery_app import create_app
    from rollout_worker.settings import Settings

    url = "redis://127.0.0.1:6379/0"
    app = create_app(Settings(redis_url=url), with_tasks=False)
    assert (app.conf.broker_url, app.conf.result_backend) == (url, url)
    assert "master_name" not in app.conf.broker_transport_options
    assert app.conf.result_backend_transport_options == {"visibility_timeout": 40}
    assert not app.conf.broker_use_ssl
    app.close()


def test_the_tls_form_reaches_kombu_and_the_result_backend_as_tls():
    from celery.backends.redis import SentinelManagedSSLConnection as CelerySSL
    from kombu.transport.redis import SentinelChannel
    from kombu.transport.redis import SentinelManagedSSLConnection as KombuSSL

    from rollout_worker.celery_app import create_app
    from rollout_worker.settings import Settings

    app = create_app(Settings(redis_url=TLS), with_tasks=False)
    with app.connection_for_write() as conn:
        assert conn.ssl["ssl_ca_certs"] == "/etc/rollout/redis-tls/ca.crt"
        # The connection parameters a channel would use (without connecting: a channel pings).
        channel = object.__new__(SentinelChannel)
        channel.connection = conn.transport
        params = channel._connparams()
        assert issubclass(params["connection_class"], KombuSSL)
        assert params["ssl_ca_certs"] == "/etc/rollout/redis-tls/ca.crt"
    backend = app.backend
    assert backend.connparams["connection_class"] is CelerySSL
    assert backend.connparams["ssl_ca_certs"] == "/etc/rollout/redis-tls/ca.crt"
    app.close()


# -- odd passwords (issue 43): no error, repr or shown URL carries any piece of one ------------
# Each password is two marker words around characters a URL gives a meaning to (or that are
# not ASCII, or broken percent-escapes): neither marker may show, so no piece of it either.
MARKERS = ("Qx7", "Zk9")
ODD = ["/", "?", "#", "@", ":", "://", "%", "%zz", "%4", "%ff", "%40", ";", ",", "[", "]", " "]
ODD += ["é", "密", "\\", "/?#@:", "@h9:1/"]
FORMS = [
    "sentinel://{auth}@h1:26379/0?master=m",  # may be a valid URL
    "sentinel://{auth}@h1:26379,h2:bad/0?master=m",
    "sentinel://{auth}@h1:26379/0",
    "sentinel://{auth}@h1:26379/x?master=m",
    "sentinel://{auth}@h1:26379/0?master=m&bogus=1",
    "sentinel+rediss://{auth}@h1:26379/0?master=m&sentinel_tls=perhaps",
    "redis://{auth}@h1:6379/0",
    "rediss://{auth}@h1:6380/0?ssl_cert_reqs=required",
    "redis://{auth}@h1:bad/0",
    "unix://{auth}@/run/redis.sock?db=1",
    "http://{auth}@h1/0",
    "redis:{auth}@h1:6379/0",  # '//' forgotten
]


def assert_no_secret(text: str, password: str) -> None:
    assert password not in text
    for marker in MARKERS:
        assert marker not in text, text


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("odd", ODD)
@pytest.mark.parametrize("user", ["", "app"])
def test_an_odd_password_never_shows_in_an_error_a_repr_or_a_shown_url(form, odd, user):
    password = odd.join(MARKERS)
    url = form.format(auth=f"{user}:{password}")
    calls = [check_url, redis_client, celery_settings]
    if is_sentinel(url):
        calls.append(parse_sentinel)
    for call in calls:
        try:
            value = call(url)
        except Exception as exc:  # whatever is raised, its message is shown somewhere
            assert_no_secret(str(exc), password)
            assert_no_secret(repr(exc), password)
        else:
            if call is parse_sentinel:
                assert_no_secret(repr(value), password)
    assert_no_secret(redacted(url), password)


@pytest.mark.parametrize("odd", ["/", "?", "#", "://", ";", "é%zz"])
def test_settings_refusing_a_url_with_an_odd_password_never_show_it(odd):
    from rollout_worker.settings import Settings

    password = odd.join(MARKERS)
    for url in (f"sentinel://:{password}@h1:26379/0", f"redis:app:{password}@h1:6379/0"):
        with pytest.raises(ConfigError) as caught:
            Settings(redis_url=url)
        assert_no_secret(str(caught.value), password)


def test_an_odd_password_percent_encoded_is_read_back_whole():
    import urllib.parse

    for odd in ODD:
        password = odd.join(MARKERS)
        quoted = urllib.parse.quote(password, safe="")
        parsed = parse_sentinel(f"sentinel://app:{quoted}@h1:26379/0?master=m")
        assert (parsed.username, parsed.password) == ("app", password)
        client = redis_client(f"redis://app:{quoted}@h1:6379/0")
        assert client.connection_pool.connection_kwargs["password"] == password
        assert_no_secret(redacted(f"redis://app:{quoted}@h1:6379/0"), password)


def test_a_raw_slash_in_a_password_is_refused_saying_to_percent_encode_it():
    with pytest.raises(ConfigError, match="percent-encode"):
        parse_sentinel("sentinel://:a/b@h1:26379/0?master=m")
    with pytest.raises(ConfigError, match="percent-encode"):
        redis_client("redis://:a/b@h1:6379/0")
